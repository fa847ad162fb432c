"""A LoRA adapter trained for real (issue 25): DeepSpeed ZeRO-2 on 2 CPU processes on the bundled demo
model, resumed exactly, loaded by peft itself, merged into a full model that the chat and training
load, and continued from its finished folder."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from test_train import accelerate, events, launch

from chat.adapters import FINGERPRINT_KEY, LORA_TARGETS, base_of, model_fingerprint
from chat.layout import DEMO_DIR
from chat.model import load_model, load_tokenizer
from finetune.jobs.command import free_port
from finetune.merge import merge

LORA = ["--model_name_or_path", str(DEMO_DIR), "--adapter", "lora", "--lora_r", "4"]
RUN = [
    "--max_train_steps",
    "12",
    "--checkpointing_steps",
    "4",
    "--logging_steps",
    "5",
    "--checkpoints_total_limit",
    "3",
]
ADAPTER_FILES = {
    "adapter_config.json",
    "adapter_model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "training_args.json",
    "all_results.json",
    "README.md",
}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    proc = launch(["--output_dir", str(out), *LORA, *RUN], launcher=accelerate("--main_process_port", str(free_port())))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def resumed_lora_run(lora_run, tmp_path_factory) -> Path:
    """lora_run as if killed right after its step-8 checkpoint, resumed with ``latest``."""
    run = tmp_path_factory.mktemp("lora-resumed") / "run"
    shutil.copytree(lora_run / "checkpoints" / "step_8", run / "checkpoints" / "step_8")
    lines = (lora_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if '"checkpoint"' in line and '"step": 8' in line)
    (run / "metrics.jsonl").write_text("".join(lines[: cut + 1]))
    proc = launch(
        ["--output_dir", str(run), *LORA, *RUN, "--resume_from_checkpoint", "latest"],
        launcher=accelerate("--main_process_port", str(free_port())),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run


def test_zero2_on_two_processes_trains_an_adapter_in_peft_s_layout(lora_run):
    ev = events(lora_run)
    assert ev[0]["event"] == "start" and ev[0]["zero_stage"] == 2 and ev[0]["num_processes"] == 2
    logs = [e for e in ev if e["event"] == "log"]
    assert [e["step"] for e in logs] == [1, 5, 10, 12] and all(
        0 < e["loss"] < 1 for e in logs
    )  # (the demo model knows the sample)
    assert ev[-1]["event"] == "done"
    final = lora_run / "final"
    assert {p.name for p in final.iterdir()} == ADAPTER_FILES  # no config.json / model.safetensors: not a full model
    assert base_of(final) == (str(DEMO_DIR.resolve()), model_fingerprint(load_model(str(DEMO_DIR))))
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and set(config["target_modules"]) == set(LORA_TARGETS)
    args = json.loads((final / "training_args.json").read_text())
    assert args["adapter"] == "lora" and args["lora_r"] == 4 and args[FINGERPRINT_KEY]
    assert args["source_prefix"] == "chatbot: "
    assert "eval_bleu" in json.loads((final / "all_results.json").read_text())
    card = (final / "README.md").read_text()
    assert "library_name: peft" in card and f"`{DEMO_DIR.resolve()}`" in card and "LoRA adapter (r 4" in card
    # a checkpoint holds the adapter and its optimizer state, not the frozen base
    step = lora_run / "checkpoints" / "step_12" / "pytorch_model"
    saved = sum(p.stat().st_size for p in step.iterdir())
    assert saved < 0.5 * (DEMO_DIR / "model.safetensors").stat().st_size, saved
    assert json.loads((lora_run / "checkpoints" / "step_12" / "trainer_state.json").read_text())[FINGERPRINT_KEY]


def test_a_resumed_adapter_run_ends_with_the_uninterrupted_runs_adapter(lora_run, resumed_lora_run):
    starts = [e for e in events(resumed_lora_run) if e["event"] == "start"]
    assert [e["resumed_at"] for e in starts] == [0, 8]
    want = load_file(lora_run / "final" / "adapter_model.safetensors")
    got = load_file(resumed_lora_run / "final" / "adapter_model.safetensors")
    assert want.keys() == got.keys() and len(want) == 2 * (2 * 6 + 2 * 10)  # A and B of 64 projections
    worst = max((want[k] - got[k]).abs().max().item() for k in want)
    assert worst < 1e-6, worst
    assert max(v.abs().max().item() for k, v in want.items() if "lora_B" in k) > 0  # it trained (B starts at 0)


def test_peft_itself_loads_the_adapter_and_the_merge_computes_the_same(lora_run, tmp_path):
    final = lora_run / "final"
    base = load_model(str(DEMO_DIR))
    model = PeftModel.from_pretrained(base, str(final)).eval()
    tokenizer = load_tokenizer(str(final))
    batch = tokenizer(["chatbot: context: happy  <s> i got a new puppy!"], return_tensors="pt")
    decoder = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        adapted = model(**batch, decoder_input_ids=decoder).logits
        with model.disable_adapter():
            plain = model(**batch, decoder_input_ids=decoder).logits
    assert (adapted - plain).abs().max() > 1e-4  # 12 steps moved it

    merged_dir = merge(final, tmp_path / "merged")
    merged = load_model(str(merged_dir)).eval()
    with torch.no_grad():
        assert (merged(**batch, decoder_input_ids=decoder).logits - adapted).abs().max() < 1e-4
    from chat.engine import load_checkpoint

    assert load_checkpoint(str(merged_dir), optimize="none").prefix == "chatbot: "
    # and training starts from the merged model like from any full model
    out = tmp_path / "from-merged"
    proc = launch(["--output_dir", str(out), "--model_name_or_path", str(merged_dir), "--max_train_steps", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "final" / "model.safetensors").is_file()


def test_continuing_a_finished_adapter_run_trains_the_same_adapter(lora_run, tmp_path):
    out = tmp_path / "continued"
    final = lora_run / "final"
    # a learning rate too small to move the weights: the run starts from the finished adapter, not a new one
    proc = launch(
        ["--output_dir", str(out), "--model_name_or_path", str(final), "--max_train_steps", "2"]
        + ["--learning_rate", "1e-12"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert base_of(out / "final") == base_of(final)  # the same base, by name and fingerprint
    args = json.loads((out / "final" / "training_args.json").read_text())
    assert (args["adapter"], args["lora_r"], args["model_name_or_path"]) == ("lora", 4, str(final))
    want = load_file(final / "adapter_model.safetensors")
    got = load_file(out / "final" / "adapter_model.safetensors")
    assert want.keys() == got.keys()
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-6
