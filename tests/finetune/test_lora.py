"""LoRA adapters in training (finetune/lora.py) and merging (finetune/merge.py), on the tiny preset
in one process: the adapter a run wraps, continues and saves, packing and evaluation through peft's
wrapper, and a merged model equal to its adapter. Real 2-process runs: test_lora_training.py."""

import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from test_packing import _features, _no_dropout
from transformers import AutoTokenizer, BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq

from chat.adapters import FINGERPRINT_KEY, LORA_TARGETS, base_of, model_fingerprint
from chat.fastgen import fast_kwargs
from chat.model import load_model, load_tokenizer
from finetune import lora
from finetune.config import TrainConfig
from finetune.evaluate import decoding_attention, generation_kwargs
from finetune.merge import MERGED_FROM, MergeError, merge
from finetune.packing import PackingCollator, install, packed


def sample_config(**kw) -> TrainConfig:
    return TrainConfig(dataset_name="sample", **kw)


def random_adapter(base="tiny", r=4, dropout=0.0, seed=0):
    """A peft LoRA model on ``base`` whose pairs are random (peft starts B at zero: no effect)."""
    torch.manual_seed(seed)
    config = LoraConfig(
        task_type=TaskType.SEQ_2_SEQ_LM,
        r=r,
        lora_alpha=2 * r,
        lora_dropout=dropout,
        target_modules=list(LORA_TARGETS),
        init_lora_weights=False,
    )
    model = get_peft_model(load_model(base), config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)  # large enough to change replies
    model.peft_config["default"].base_model_name_or_path = base
    return model


def save_adapter(model, folder, fingerprint=None):
    """An adapter folder as a LoRA run's final/ holds it (peft's files, tokenizer, training_args)."""
    model.save_pretrained(folder, save_embedding_layers=False)
    load_tokenizer("tiny").save_pretrained(folder)
    args = {**sample_config(adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.0).to_dict()}
    args[FINGERPRINT_KEY] = fingerprint or model_fingerprint(model.get_base_model())
    (folder / "training_args.json").write_text(json.dumps(args))
    return folder


# --------------------------------------------------------------------------- what a run wraps


def test_a_new_adapter_freezes_the_base_and_names_it(tiny_path, tmp_path, monkeypatch):
    model = lora.wrap(load_model("tiny"), sample_config(adapter="lora", lora_r=4), "tiny")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert model.peft_config["default"].base_model_name_or_path == "tiny"
    assert model.peft_config["default"].r == 4 and model.peft_config["default"].task_type == "SEQ_2_SEQ_LM"
    assert model.base_fingerprint == model_fingerprint(load_model("tiny"))
    assert lora.base_model(sample_config(model_name_or_path="tiny", adapter="lora")) == "tiny"
    assert lora.base_model(sample_config(model_name_or_path="user/bot", adapter="lora")) == "user/bot"
    # a local base (a finished full run, the demo model) is named by its absolute path
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_path, tmp_path / "full")
    assert lora.base_model(sample_config(model_name_or_path="full", adapter="lora")) == str(tmp_path.resolve() / "full")


def test_continuing_a_finished_adapter_trains_the_same_adapter_on_its_base(tmp_path):
    saved = random_adapter()
    folder = save_adapter(saved, tmp_path / "final")
    cfg = sample_config(model_name_or_path=str(folder))
    # the folder makes it a LoRA run with the adapter's own settings, on the adapter's base
    assert lora.prepare(cfg) == "tiny"
    assert (cfg.adapter, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == ("lora", 4, 8, 0.0)
    assert set(cfg.lora_target_modules) == set(LORA_TARGETS)
    model = lora.wrap(load_model("tiny"), cfg, "tiny")
    assert model.peft_config["default"].base_model_name_or_path == "tiny"
    want = {n: p for n, p in saved.named_parameters() if "lora_" in n}
    got = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    assert all(p.requires_grad for p in got.values())  # trainable again (peft loads for inference by default)
    # a value given that contradicts the adapter's own is refused
    from chat.model import ModelLoadError

    with pytest.raises(ModelLoadError, match="--lora_r 16 differs from the adapter's own 4"):
        lora.prepare(sample_config(model_name_or_path=str(folder), adapter="lora", lora_r=16))
    agreeing = sample_config(model_name_or_path=str(folder), adapter="lora", lora_r=4)
    assert lora.prepare(agreeing) == "tiny" and agreeing.lora_alpha == 8


def test_continuing_an_adapter_whose_base_changed_is_refused(tmp_path):
    folder = save_adapter(random_adapter(), tmp_path / "final", fingerprint="0123456789abcdef")
    cfg = sample_config(model_name_or_path=str(folder))
    from chat.model import ModelLoadError

    with pytest.raises(ModelLoadError, match="fingerprint 0123456789abcdef, but tiny now has"):
        lora.wrap(load_model("tiny"), cfg, lora.prepare(cfg))


def test_a_checkpoint_of_another_base_is_refused_on_resume(tmp_path):
    model = lora.wrap(load_model("tiny"), sample_config(adapter="lora"), "tiny")
    state = lora.checkpoint_state(model)
    assert state == {FINGERPRINT_KEY: model.base_fingerprint}
    lora.check_resume(state, model, tmp_path)  # the same base: fine
    with pytest.raises(lora.TrainingError, match="resume is not possible"):
        lora.check_resume({FINGERPRINT_KEY: "0123456789abcdef"}, model, tmp_path)
    assert lora.save_kwargs(sample_config(adapter="lora"), 2) == {"exclude_frozen_parameters": True}
    assert lora.save_kwargs(sample_config(adapter="lora"), 3) == {} == lora.save_kwargs(sample_config(), 2)
    assert lora.load_kwargs(sample_config(adapter="lora"), None) == {}  # one process: accelerate saves everything


def test_loading_a_checkpoint_without_a_trainable_weight_is_an_error():
    model = lora.wrap(load_model("tiny"), sample_config(adapter="lora"), "tiny")
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    lora.load_trainable(trainable, model)  # only the trainable weights: what a LoRA checkpoint holds
    with pytest.raises(lora.TrainingError, match="missing"):
        lora.load_trainable(dict(list(trainable.items())[1:]), model)


# --------------------------------------------------------------------------- training through peft's wrapper


def test_packed_batches_reach_through_peft_and_give_the_padded_loss_and_lora_gradients():
    tokenizer = load_tokenizer("tiny")
    model = _no_dropout(random_adapter())
    features = _features(tokenizer)
    padded = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)(features)
    loss = model(**padded).loss
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert expected and all("lora_" in n for n in expected)  # the base gets no gradients

    install(model)  # the recipe installs the hooks on the peft model
    batch = PackingCollator(tokenizer.pad_token_id, model.config.decoder_start_token_id, 128, 64, multiple=8)(features)
    model.zero_grad()
    with packed(batch) as inputs:
        packed_loss = model(**inputs).loss
        packed_loss.backward()
    assert packed_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    for name, grad in expected.items():
        got = dict(model.named_parameters())[name].grad
        assert (got - grad).abs().max() <= 1e-5 * max(grad.abs().max().item(), 1.0), name


@pytest.mark.parametrize("eval_attention", ["grouped", "eager", "sdpa"])
def test_evaluation_decodes_through_the_adapter(eval_attention):
    """Evaluation's fast paths (grouped cross-attention, its cache, the tensorized n-gram rules) give
    the plain generate() of the same adapter, and the adapter changes the replies."""
    tokenizer = load_tokenizer("tiny")
    model = random_adapter().eval()
    features = _features(tokenizer, 6)
    batch = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)(features)
    cfg = sample_config(num_beams=4, val_min_target_length=2, val_max_target_length=16, eval_attention=eval_attention)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        plain = model.generate(**inputs, **generation_kwargs(cfg))
        with decoding_attention(model, cfg):
            fast = model.generate(**inputs, **fast_kwargs(generation_kwargs(cfg), batch["input_ids"]))
        with model.disable_adapter():
            base = model.generate(**inputs, **generation_kwargs(cfg))
    assert model.config._attn_implementation == "sdpa"  # back to the training kernels
    assert torch.equal(plain, fast)
    assert not torch.equal(plain, base)


# --------------------------------------------------------------------------- merging


def test_merged_model_gives_the_adapters_outputs_and_loads_everywhere(tmp_path):
    adapter = random_adapter().eval()
    folder = save_adapter(adapter, tmp_path / "run" / "final")
    out = merge(folder, tmp_path / "merged")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "training_args.json",
        ]
    )
    assert not list(tmp_path.glob(".merged.tmp-*"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["chatbot: context: happy  <s> i got a new puppy!", "chatbot: <s> hello there"], padding=True)
    batch = {k: torch.tensor(v) for k, v in batch.items()}
    decoder = torch.tensor([[1, 5, 6, 7], [1, 8, 9, 10]])
    merged = BlenderbotForConditionalGeneration.from_pretrained(out, use_safetensors=True).eval()
    with torch.no_grad():
        want = adapter(**batch, decoder_input_ids=decoder).logits
        got = merged(**batch, decoder_input_ids=decoder).logits
        base = load_model("tiny")(**batch, decoder_input_ids=decoder).logits
    assert (want - base).abs().max() > 1e-2  # the adapter matters...
    assert (want - got).abs().max() < 1e-4  # ...and the merged model computes what it does
    args = json.loads((out / "training_args.json").read_text())
    assert args["source_prefix"] == "chatbot: " and args["adapter"] == "lora"
    assert args[MERGED_FROM] == {
        "adapter": str(folder.resolve()),
        "base": "tiny",
        FINGERPRINT_KEY: model_fingerprint(load_model("tiny")),
    }
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card and "merged into its weights" in card
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["num_beams"] == 10 and gen["decoder_start_token_id"] == 1  # the run's evaluation settings
    # the chat serves it, and training starts from it, like any full model
    from chat.engine import load_checkpoint

    loaded = load_checkpoint(str(out), optimize="none")
    assert loaded.prefix == "chatbot: " and loaded.trained_args["adapter"] == "lora"
    # LoRA leaves the embeddings alone: a merged model has its base's fingerprint (its name tells them apart)
    assert model_fingerprint(load_model(str(out))) == model_fingerprint(load_model("tiny"))


def test_merge_errors_are_clear_and_leave_nothing_behind(tmp_path, tiny_path, monkeypatch):
    with pytest.raises(MergeError, match="is not a LoRA adapter folder"):
        merge(tiny_path, tmp_path / "out")
    folder = save_adapter(random_adapter(), tmp_path / "final")
    (tmp_path / "taken").mkdir()
    with pytest.raises(MergeError, match="already exists"):
        merge(folder, tmp_path / "taken")
    # a base that cannot be loaded
    config = json.loads((folder / "adapter_config.json").read_text())
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("adapter_model.safetensors", "training_args.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, moved / name)
    gone = {**config, "base_model_name_or_path": str(tmp_path / "gone")}
    (moved / "adapter_config.json").write_text(json.dumps(gone))
    with pytest.raises(MergeError, match="cannot load the base"):
        merge(moved, tmp_path / "out")
    # a base that changed since the adapter was trained
    args = json.loads((folder / "training_args.json").read_text())
    (folder / "training_args.json").write_text(json.dumps({**args, FINGERPRINT_KEY: "0123456789abcdef"}))
    with pytest.raises(MergeError, match="changed since the adapter was trained"):
        merge(folder, tmp_path / "out")
    (folder / "training_args.json").write_text(json.dumps(args))
    # a failure while writing leaves no output folder and no temporary one
    from transformers import PreTrainedTokenizerBase

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", fail)
    with pytest.raises(MergeError, match="disk full while writing"):
        merge(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert base_of(folder) == ("tiny", args[FINGERPRINT_KEY])


def test_merge_command_line(tmp_path, capsys, caplog):
    from finetune.merge import main

    folder = save_adapter(random_adapter(), tmp_path / "final")
    assert main(["--adapter_dir", str(folder), "--output_dir", str(tmp_path / "full")]) == 0
    assert (tmp_path / "full" / "model.safetensors").is_file()
    assert main(["--adapter_dir", str(folder), "--output_dir", str(tmp_path / "full")]) == 1
    assert "already exists" in caplog.text
    # peft itself loads the adapter the same way the merge did
    peft_model = PeftModel.from_pretrained(load_model("tiny"), str(folder))
    assert peft_model.peft_config["default"].base_model_name_or_path == "tiny"


# --------------------------------------------------------------------------- the fused LoRA layers


@pytest.mark.parametrize("dropout, recompute_on", [(0.0, "cpu"), (0.3, "cpu"), (0.3, "cuda")])
def test_fused_layers_train_exactly_as_peft_s_and_keep_no_dropout_copies(dropout, recompute_on, monkeypatch):
    """On a GPU the dropout is recomputed in the backward pass (here the CPU plays it); on a CPU it is
    kept, as peft does (drawing the mask is what costs there)."""
    import copy

    from finetune import lora_layer
    from finetune.lora_layer import FusedLinear, fuse

    monkeypatch.setattr(lora_layer, "RECOMPUTE_DROPOUT_ON", (recompute_on,))

    tokenizer = load_tokenizer("tiny")
    batch = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)(_features(tokenizer, 16))
    stock = random_adapter(dropout=dropout).train()
    fused = copy.deepcopy(stock)
    assert fuse(fused) == 2 * 6 + 2 * 10  # every wrapped projection of the tiny model
    outcome = {}
    for name, model in (("stock", stock), ("fused", fused)):
        kept = []

        def pack(t, kept=kept):
            kept.append(t.numel() * t.element_size())
            return t

        torch.manual_seed(5)  # the same dropout masks for both
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        outcome[name] = (loss.item(), grads, sum(kept), torch.rand(1).item())  # (the RNG stream after the step too)
    (loss, grads, kept, after), (fused_loss, fused_grads, fused_kept, fused_after) = outcome["stock"], outcome["fused"]
    assert fused_loss == pytest.approx(loss, rel=1e-6) and fused_after == after
    assert grads.keys() == fused_grads.keys()
    assert max((grads[n] - fused_grads[n]).abs().max().item() for n in grads) < 1e-6
    if dropout and recompute_on == "cpu":
        assert fused_kept < 0.9 * kept  # peft keeps each projection's dropped input and mask; fused recomputes them
    else:
        assert fused_kept == kept
    # the same adapter on disk, and peft's own paths where they apply (a merged or disabled adapter)
    assert fused.state_dict().keys() == stock.state_dict().keys()
    layer = next(m for m in fused.eval().modules() if isinstance(m, FusedLinear))
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        live = layer(x)
        with fused.disable_adapter():
            assert torch.equal(layer(x), layer.base_layer(x))
        layer.merge()
        assert torch.allclose(layer(x), live, atol=1e-5)
        layer.unmerge()


def test_an_adapter_s_model_card_names_its_base_and_peft(tmp_path):
    from huggingface_hub import ModelCard

    from finetune.hub import write_model_card

    cfg = sample_config(adapter="lora", lora_r=4)
    for base, metadata in (("facebook/blenderbot-400M-distill", "facebook/blenderbot-400M-distill"), ("tiny", None)):
        write_model_card(tmp_path, cfg, {"eval_bleu": 1.5}, 1, adapter_base=base)
        card = ModelCard.load(tmp_path / "README.md")
        assert card.data.library_name == "peft" and "lora" in card.data.tags
        # the Hub refuses a base_model that is no Hub id (a preset, a local folder): then the text alone names it
        assert card.data.base_model == metadata and f"Base model: `{base}`" in card.text
        assert "LoRA adapter (r 4, alpha 16" in card.text and "python -m finetune.merge" in card.text
    write_model_card(tmp_path, sample_config(model_name_or_path="/abs/run/final"), {}, 1)
    full = ModelCard.load(tmp_path / "README.md")
    assert full.data.library_name == "transformers" and full.data.base_model is None  # (a local folder)
