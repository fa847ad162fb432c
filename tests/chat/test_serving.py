"""Many LoRA adapters on one base (chat/serving.py through chat.engine), on real models.

The adapters are real peft adapters of the bundled demo model (tests/adapter_files.py: peft's own
save_pretrained plus the training_args.json training writes), with random non-zero LoRA weights so
each one answers differently. The reference for "the same reply" is peft's own PeftModel."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from adapter_files import make_adapter
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration, GenerationConfig

import chat.loading
from chat.adapters import ADAPTER_WEIGHTS
from chat.engine import DEMO_DIR, GENERATION_PRESETS, ChatEngine, Conversation, InputError, load_checkpoint
from chat.lora import ServedLoraLinear
from chat.model import load_model, load_tokenizer
from chat.optimize import Int8Linear
from chat.serving import AdapterError

HELLO = "hi! what do you like to do?"
FAST = GENERATION_PRESETS["fast"]
FAITHFUL = GENERATION_PRESETS["faithful"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three adapters of the demo model, in run folders named like training's (RUN/final/)."""
    root = tmp_path_factory.mktemp("runs")
    return {name: make_adapter(DEMO_DIR, root / name, seed=seed) for seed, name in enumerate(("bob", "ann", "eve"))}


@pytest.fixture
def engine():
    """An engine of its own serving a freshly loaded demo model (adapters change its model object)."""
    return ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), f"serving {DEMO_DIR}")


@pytest.fixture
def loads(monkeypatch):
    """The specs loaded from disk as full models (the real loader runs)."""
    specs, real = [], chat.loading.load_checkpoint

    def spy(spec, optimize=None):
        specs.append(spec)
        return real(spec, optimize)

    monkeypatch.setattr(chat.loading, "load_checkpoint", spy)
    return specs


def demo_model(device: str = "cpu"):
    """The demo model as transformers loads it, with only the token ids of its saved generation
    config (as the engine keeps them: the rest are training's evaluation settings)."""
    model = load_model(str(DEMO_DIR)).to(device).eval()
    saved = model.generation_config
    ids = ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "forced_eos_token_id")
    model.generation_config = GenerationConfig(**{name: getattr(saved, name) for name in ids})
    return model


def peft_reply(folder, conv: Conversation, settings=FAST) -> list[int]:
    """peft's own answer: PeftModel on a freshly loaded demo model, the engine's input and settings."""
    reference = PeftModel.from_pretrained(demo_model(), str(folder)).eval()
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "reference input")
    encoded, _ = engine.build_input(conv)
    with torch.inference_mode():
        return reference.generate(**encoded, **settings.generate_kwargs())[0].tolist()


def engine_reply(engine: ChatEngine, conv: Conversation, settings=FAST) -> list[int]:
    loaded = engine.model_for(conv.model)
    encoded, _ = engine.build_input(conv, loaded)
    return engine._generate(loaded, encoded, settings.generate_kwargs())[0].tolist()


def test_two_adapters_on_one_base_reply_as_peft_does(engine, adapters, loads):
    base = engine.current
    before = {s: engine_reply(engine, Conversation("persona", "i love dogs.", [HELLO]), s) for s in (FAST, FAITHFUL)}
    assert "serving bob (LoRA on demo-model)" == engine.swap(str(adapters["bob"].parent))  # a run folder
    ann = engine.load(str(adapters["ann"]))  # the final/ folder itself; not what new chats get
    assert loads == []  # the base was not loaded again ...
    assert engine.base is base and engine.current.model is base.model and ann.model is base.model  # ... nor copied
    assert engine.current.id == "bob" and ann.id == "ann" and engine.model_ids() == ["demo-model", "bob", "ann"]
    for settings in (FAST, FAITHFUL):  # greedy and beam 10, token for token
        replies = {}
        for model in ("bob", "ann", "demo-model", "bob"):  # switching back and forth
            conv = Conversation("persona", "i love dogs.", [HELLO], model=model)
            replies[model] = engine_reply(engine, conv, settings)
            if model != "demo-model":
                assert replies[model] == peft_reply(adapters[model], conv, settings)
        assert replies["demo-model"] == before[settings]  # the base still serves itself, unchanged
        assert len({tuple(r) for r in replies.values()}) == 3  # each adapter answers in its own way
    # New conversations get the current model; a conversation names its own.
    assert engine.reply(Conversation("persona", "i love dogs."), HELLO) == engine.reply(
        Conversation("persona", "i love dogs.", model="bob"), HELLO
    )


def test_a_conversation_keeps_its_adapter_across_a_swap(engine, adapters):
    engine.swap(str(adapters["bob"]))
    started = Conversation("topic", "jazz", model=engine.current.id)  # what the UI and the API keep
    first = engine.reply(started, HELLO)[0]
    engine.swap(str(adapters["ann"]))  # a trainer serves another adapter to everyone
    assert engine.current.id == "ann"
    assert engine.reply(started, HELLO)[0] == first  # the old chat still talks to bob
    assert engine.reply(Conversation("topic", "jazz"), HELLO)[0] != first  # a new one to ann
    stream = list(engine.stream(started, HELLO))
    assert stream[-1][0] == first


def test_least_recently_used_adapters_are_unloaded_and_come_back(engine, adapters):
    engine.swap(str(adapters["bob"]))
    host = engine.base.host
    one = host.adapter_bytes()
    host.budget_bytes = 2 * one  # room for two adapters of this size
    conv = {name: Conversation("none", "", model=name) for name in adapters}
    bob = engine.reply(conv["bob"], HELLO)[0]
    engine.load(str(adapters["ann"]))
    ann = engine.reply(conv["ann"], HELLO)[0]
    engine.reply(conv["bob"], HELLO)  # bob used after ann: ann is now the least recently used
    eve = engine.load(str(adapters["eve"]))
    assert [engine._models.get(n).adapter for n in ("bob", "eve")] == host.attached()[-2:]
    assert not host.has(engine._models.get("ann").adapter) and host.adapter_bytes() <= 2 * one
    assert engine.model_ids() == ["demo-model", "bob", "ann", "eve"]  # ann still served: attached on demand
    assert engine.reply(conv["ann"], HELLO)[0] == ann  # gets it back, the same adapter
    assert host.has(engine._models.get("ann").adapter) and len(host.attached()) == 2
    assert not host.has(eve.adapter)  # ann back: eve, the least recently used, made room
    # The model new chats start with (bob) is never the one unloaded, however long unused.
    for name in ("eve", "ann", "eve"):
        engine.reply(conv[name], HELLO)
    assert host.attached() == [engine._models.get("bob").adapter, eve.adapter]
    assert engine.reply(conv["bob"], HELLO)[0] == bob


def test_an_adapter_of_another_base_is_refused_naming_both(engine, adapters, tiny_path, tmp_path):
    # Trained on the tiny preset (same shapes as the demo model) but naming the demo model as its
    # base: the recorded fingerprint tells them apart, where loading would succeed and serve noise.
    wrong = make_adapter(tiny_path, tmp_path / "wrong", base_name=str(DEMO_DIR))
    engine.swap(str(adapters["bob"]))
    with pytest.raises(AdapterError) as refused:
        engine.swap(str(wrong))
    message = str(refused.value)
    assert "wrong was trained on demo-model" in message and "the model found as demo-model is another" in message
    assert str(DEMO_DIR) not in message  # ids, not server paths
    assert engine.current.id == "bob" and engine.model_ids() == ["demo-model", "bob"]  # nothing changed


def narrow_model(dest) -> str:
    """A BlenderBot of another width than the demo model's (64 instead of 128), saved with its tokenizer."""
    config = BlenderbotConfig.from_pretrained(str(DEMO_DIR))
    config.d_model, config.encoder_ffn_dim, config.decoder_ffn_dim = 64, 256, 256
    BlenderbotForConditionalGeneration(config).save_pretrained(dest)
    load_tokenizer(str(DEMO_DIR)).save_pretrained(dest)
    return str(dest)


def test_an_adapter_whose_shapes_do_not_fit_is_refused_naming_both(engine, tmp_path):
    # Recorded no fingerprint (made elsewhere) and names the demo model: matched by name, then the
    # shapes decide.
    narrow = narrow_model(tmp_path / "narrow")
    misfit = make_adapter(narrow, tmp_path / "misfit", base_name=str(DEMO_DIR), fingerprint=False)
    before = engine_reply(engine, Conversation("none", "", [HELLO]))
    expected = r"misfit \(a LoRA adapter of demo-model\) does not fit demo-model, the model found: "
    with pytest.raises(AdapterError, match=expected) as refused:
        engine.swap(str(misfit))
    assert "shapes differ" in str(refused.value) and "[4, 64]" in str(refused.value)
    assert engine.current.id == "demo-model" and engine.model_ids() == ["demo-model"]
    assert engine_reply(engine, Conversation("none", "", [HELLO])) == before  # no layer left half-attached


def test_an_adapter_of_a_base_not_served_loads_that_base(engine, tiny_path, tmp_path, loads):
    demo_chat = Conversation("none", "", model="demo-model")
    engine.reply(demo_chat, HELLO)
    on_tiny = make_adapter(tiny_path, tmp_path / "tiny-bot", base_name="tiny")
    engine.swap(str(on_tiny))
    assert loads == ["tiny"]  # the base it names, loaded once
    assert engine.base.id == "tiny" and engine.current.id == "tiny-bot" and engine.model_ids() == ["tiny", "tiny-bot"]
    with pytest.raises(InputError, match="This chat was with demo-model, which is no longer loaded"):
        engine.reply(demo_chat, HELLO)  # the old base left: a clear note, not a reply from another model
    with pytest.raises(InputError, match="Unknown model 'nobody'; models served now: tiny, tiny-bot"):
        engine.reply(Conversation(model="nobody"), HELLO)


def test_chat_model_may_be_an_adapter_run(adapters, monkeypatch):
    monkeypatch.setenv("CHAT_MODEL", str(adapters["bob"].parent))
    engine = ChatEngine.start()
    assert engine.current.id == "bob" and engine.base.id == "demo-model" and engine.model_ids() == ["demo-model", "bob"]
    assert engine.current.model is engine.base.model


def test_a_retrained_adapter_is_read_again_and_an_unchanged_one_is_not(engine, adapters, tmp_path):
    run = tmp_path / "carl"
    shutil.copytree(adapters["bob"].parent, run)
    engine.swap(str(run))
    first = engine.current
    assert engine.load(str(run)) is first  # unchanged on disk: nothing read
    make_adapter(DEMO_DIR, tmp_path / "other", seed=9)
    shutil.copy(tmp_path / "other" / "final" / ADAPTER_WEIGHTS, run / "final" / ADAPTER_WEIGHTS)
    engine.swap(str(run))
    assert engine.current is not first and engine.current.id == "carl"  # same id, new weights
    assert not engine.base.host.has(first.adapter)  # the old version is unloaded
    conv = Conversation("none", "", [HELLO], model="carl")
    assert engine_reply(engine, conv) == peft_reply(tmp_path / "other" / "final", conv)


def test_input_format_comes_from_the_adapters_training_args(engine, adapters, tmp_path):
    run = tmp_path / "terse"
    shutil.copytree(adapters["bob"].parent, run)
    file = run / "final" / "training_args.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "source_prefix": "", "max_source_length": 32}))
    engine.swap(str(run))
    assert (engine.current.prefix, engine.current.max_source_length) == ("", 32)
    assert engine.base.prefix == "chatbot: "  # the base keeps its own
    encoded, budget = engine.build_input(Conversation("none", "", [HELLO * 10]), engine.current)
    assert budget.max_tokens == 32 and 16 < encoded["input_ids"].shape[1] <= 32
    assert not engine.current.tokenizer.decode(encoded["input_ids"][0]).strip().startswith("chatbot")


def test_int8_serves_an_adapter_with_fp32_lora_weights(adapters):
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="int8"), "int8")
    base_reply = engine.reply(Conversation("none", ""), HELLO)[0]
    engine.swap(str(adapters["bob"]))
    layer = engine.base.model.model.decoder.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, Int8Linear)  # the product stays int8 ...
    assert layer.lora_A[engine.current.adapter].weight.dtype == torch.float32  # ... the adapter fp32
    # The adapter's effect survives quantization: int8 + adapter logits are near fp32 peft's with
    # the adapter, and nearer to them than to the base's.
    conv = Conversation("none", "", [HELLO])
    encoded, _ = engine.build_input(conv, engine.current)
    decoder = torch.tensor([[1, 5, 17, 42, 99, 7]])
    reference = PeftModel.from_pretrained(demo_model(), str(adapters["bob"])).eval()
    with torch.inference_mode(), engine.current.activated():
        ours = engine.current.model(**encoded, decoder_input_ids=decoder).logits
    with torch.inference_mode():
        theirs = reference(**encoded, decoder_input_ids=decoder).logits
        with reference.disable_adapter():
            plain = reference(**encoded, decoder_input_ids=decoder).logits
    error = (ours - theirs).norm() / theirs.norm()
    assert error < 0.08 and error < (plain - theirs).norm() / theirs.norm() / 2
    assert engine.reply(Conversation("none", "", model="demo-model"), HELLO)[0] == base_reply
    assert engine.reply(Conversation("none", ""), HELLO)[0]  # the adapter replies through the engine


def test_the_lean_cpu_forward_gives_peft_forwards_numbers(adapters, monkeypatch):
    """chat.lora.ServedLoraLinear's straight paths against peft's own forward, on the int8 base
    (where peft's PeftModel cannot run): the same logits to the bit, the same replies, for the
    adapter and for the base beside it; and they are the paths the replies took."""
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="int8"), "int8")
    engine.swap(str(adapters["bob"]))
    layers = [m for m in engine.base.model.modules() if isinstance(m, ServedLoraLinear)]
    encoded, _ = engine.build_input(Conversation("none", "", [HELLO]), engine.current)
    decoder = torch.tensor([[1, 5, 17, 42, 99, 7]])
    results = {}
    for lean in (True, False):
        monkeypatch.setattr(ServedLoraLinear, "lean", lean)
        for layer in layers:
            layer._invalidate()
        for loaded in (engine.current, engine.base):
            with torch.inference_mode(), loaded.activated():
                logits = loaded.model(**encoded, decoder_input_ids=decoder).logits
            replies = [
                engine.reply(Conversation("persona", p, model=loaded.id), HELLO)[0]
                for p in ("i love dogs.", "i am a nurse.")
            ]
            results[lean, loaded.id] = logits, replies
            kinds = {layer._plan[0] for layer in layers if layer._plan is not None}
            assert kinds == ({"lora" if loaded.adapter else "base"} if lean else {"peft"}), kinds
    for model in ("bob", "demo-model"):
        assert torch.equal(results[True, model][0], results[False, model][0])
        assert results[True, model][1] == results[False, model][1]


def test_each_adapter_gets_cuda_graphs_of_its_own(tiny_path):
    """A recorded step replays the adapter active when it was recorded: the adapter is part of the
    shape's key (the static-cache path runs eagerly on a CPU; the GPU test below replays it)."""
    from chat.graphs import StepGraphs

    model = load_model(str(tiny_path)).eval()
    ids = torch.ones((1, 16), dtype=torch.long)
    graphs, kwargs = StepGraphs(), dict(num_beams=1, max_new_tokens=4)
    for variant in ("adapter_1", "adapter_2", None, "adapter_1"):
        with graphs.decoding(model, ids, kwargs, variant):
            pass
    assert len(graphs._entries) == 3 and [key[-1] for key in graphs._entries] == ["adapter_2", None, "adapter_1"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_adapters_on_a_gpu_replay_their_own_cuda_graphs(adapters, monkeypatch):
    """On a GPU with CUDA-graph decoding (the default, CHAT_CUDA_GRAPHS=capture), switching adapters
    on one base gives each its own graphs: every reply, replayed or not, equals peft's eager one."""
    from chat.graphs import for_model

    monkeypatch.setenv("CHAT_CUDA_GRAPHS", "capture")
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "gpu")
    assert engine.base.model.device.type == "cuda" and engine._batcher.cuda_graphs == "capture"
    engine.swap(str(adapters["bob"]))
    engine.load(str(adapters["ann"]))
    conv = {m: Conversation("persona", "i love dogs.", [HELLO], model=m) for m in ("bob", "ann", "demo-model")}
    expected = {}
    for model, folder in (("bob", adapters["bob"]), ("ann", adapters["ann"]), ("demo-model", None)):
        reference = demo_model("cuda")
        if folder is not None:
            reference = PeftModel.from_pretrained(reference, str(folder)).eval()
        encoded, _ = engine.build_input(conv[model], engine.model_for(model))
        with torch.inference_mode():
            expected[model] = {
                s.num_beams: reference.generate(**{k: v.cuda() for k, v in encoded.items()}, **s.generate_kwargs())[0]
                .cpu()
                .tolist()
                for s in (FAST, FAITHFUL)
            }
    graphs = for_model(engine.base.model)
    for _ in range(3):  # recorded on a shape's first uses, replayed after: interleaved adapters
        for model in ("bob", "ann", "demo-model"):
            for settings in (FAST, FAITHFUL):
                assert engine_reply(engine, conv[model], settings) == expected[model][settings.num_beams], model
    assert graphs.replays > 0 and not any(entry.failed for entry in graphs._entries.values())
    assert {key[-1] for key in graphs._entries} == {engine.model_for(m).adapter for m in ("bob", "ann", "demo-model")}


def test_bf16_serves_an_adapter_in_bf16_through_pefts_forward(adapters):
    engine = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="bf16"), "bf16")
    engine.swap(str(adapters["bob"]))
    layer = engine.base.model.model.decoder.layers[0].fc1
    assert layer.lora_B[engine.current.adapter].weight.dtype == torch.bfloat16  # peft casts it to the base's dtype
    replies = {m: engine.reply(Conversation("none", "", model=m), HELLO)[0] for m in ("bob", "demo-model")}
    assert all(replies.values()) and replies["bob"] != replies["demo-model"]


def poison(final) -> None:
    """One NaN in one of the adapter's matrices."""
    state = load_file(str(final / ADAPTER_WEIGHTS))
    state["base_model.model.model.decoder.layers.0.fc1.lora_A.weight"][0, 0] = float("nan")
    save_file(state, str(final / ADAPTER_WEIGHTS))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "adapter_config.json").write_text("{not json"), "broken: adapter_config.json: unreadable"),
        (lambda f: (f / "adapter_model.safetensors").write_bytes(b"\0" * 64), "unreadable adapter_model.safetensors"),
        (lambda f: (f / "training_args.json").write_text("[1]"), "training_args.json is not a JSON object"),
        (poison, r"broken \(a LoRA adapter of demo-model\): non-finite weights in base_model.model.model.decoder"),
    ],
)
def test_damaged_adapter_files_are_refused_with_the_file_named(engine, adapters, tmp_path, damage, message):
    run = tmp_path / "broken"
    shutil.copytree(adapters["bob"].parent, run)
    damage(run / "final")
    with pytest.raises(Exception, match=message):
        engine.swap(str(run))
    assert engine.current.id == "demo-model" and engine.model_ids() == ["demo-model"]
