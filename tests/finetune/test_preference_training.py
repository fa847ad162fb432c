"""Preference tuning for real (issue 27): DPO and KTO from the bundled demo model on the shipped
sample preference set (chosen = the dataset's reply, rejected = the demo model's own greedy reply,
data/sample/preferences-*.jsonl), DeepSpeed ZeRO-2 on 2 CPU processes as the app runs it: held-out
preference accuracy rises by at least 40 points with BLEU within 2 points of its start (full
fine-tuning; with a LoRA adapter by 40 points, its BLEU drop reported and flagged past 2 points);
a resumed run ends with the uninterrupted run's weights; KTO raises its accuracy; bad preference
files fail before training, naming the file, row and problem."""

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_train import accelerate, errors, events, launch

from chat.layout import DEMO_DIR, SAMPLE_DIR
from finetune.jobs.command import free_port
from finetune.sample_preferences import kto_rows, read_rows

PREFS = [
    "--preference_file",
    str(SAMPLE_DIR / "preferences-train.jsonl"),
    "--preference_validation_file",
    str(SAMPLE_DIR / "preferences-validation.jsonl"),
]
# The demo model, evaluated as it was trained (4 beams, no n-gram blocking, min length 1) on the
# whole validation split; 2 processes x 8 pairs: one epoch of the 558 train pairs is 35 steps.
DEMO = [
    "--model_name_or_path",
    str(DEMO_DIR),
    "--n_val",
    "187",
    "--num_beams",
    "4",
    "--val_min_target_length",
    "1",
    "--no_repeat_ngram_size",
    "0",
    "--encoder_no_repeat_ngram_size",
    "0",
    "--repetition_penalty",
    "1.0",
    "--per_device_eval_batch_size",
    "32",
    "--logging_steps",
    "10",
    "--per_device_train_batch_size",
    "8",
]
# Two epochs at a small learning rate (measured on 2 CPU processes: held-out accuracy 0.034 -> 0.449,
# BLEU 60.00 -> 59.01; at 1e-4 accuracy rose further but BLEU fell 3.6 points, see the report in
# docs/benchmarks.md).
DPO = ["--objective", "dpo", *PREFS, "--beta", "0.1", "--learning_rate", "6e-5"]
STEPS = ["--max_train_steps", "70", "--checkpointing_steps", "40"]


def run_zero2(out: Path, args: list[str]) -> Path:
    port = str(free_port())  # (10 minutes: the shared 2-core machine is slow when busy)
    proc = launch(
        ["--output_dir", str(out), *DEMO, *args], launcher=accelerate("--main_process_port", port), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def start_and_end(out: Path) -> tuple[dict, dict]:
    evals = [e for e in events(out) if e["event"] == "eval"]
    assert evals[0]["step"] == 0 and evals[0]["start"] is True and "start" not in evals[-1]
    return evals[0], evals[-1]


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory) -> Path:
    return run_zero2(tmp_path_factory.mktemp("dpo") / "run", [*DPO, *STEPS])


def test_dpo_on_two_zero2_processes_learns_the_preferences_and_keeps_bleu(dpo_run):
    ev = events(dpo_run)
    assert ev[0]["event"] == "start" and ev[0]["zero_stage"] == 2 and ev[0]["num_processes"] == 2
    assert ev[0]["train_samples"] == 558 and ev[0]["total_steps"] == 70
    start, end = start_and_end(dpo_run)
    # the demo model prefers its own reply on nearly every held-out pair
    assert start["eval_pref_rows"] == end["eval_pref_rows"] == 118
    assert start["eval_pref_accuracy"] < 0.1 and start["eval_pref_margin"] < 0
    assert end["eval_pref_accuracy"] >= start["eval_pref_accuracy"] + 0.40, (start, end)
    assert end["eval_pref_margin"] > start["eval_pref_margin"]
    assert abs(end["eval_bleu"] - start["eval_bleu"]) <= 2.0, (start["eval_bleu"], end["eval_bleu"])
    logs = [e for e in ev if e["event"] == "log"]
    assert logs[0]["loss"] == pytest.approx(0.6931, abs=1e-3) and logs[-1]["loss"] < 0.65  # (DPO starts at log 2)
    results = json.loads((dpo_run / "all_results.json").read_text())
    for key in ("eval_bleu", "eval_pref_accuracy", "eval_pref_margin", "eval_pref_rows"):
        assert results[key] == end[key]
    assert results["start_eval_bleu"] == start["eval_bleu"]
    assert results["start_eval_pref_accuracy"] == start["eval_pref_accuracy"]
    assert results["objective"] == "dpo" and results["preference_rows"] == 558
    assert results["bleu_drop"] == pytest.approx(start["eval_bleu"] - end["eval_bleu"])
    assert results["bleu_drop_flag"] is False
    card = (dpo_run / "final" / "README.md").read_text()
    assert "Objective: DPO (beta 0.1) on 558 preference rows (`preferences-train.jsonl`)" in card
    assert f"Held-out preferences: accuracy {end['eval_pref_accuracy']:.2f}" in card and "flagged" not in card
    args = json.loads((dpo_run / "final" / "training_args.json").read_text())
    assert args["objective"] == "dpo" and args["packing"] is False


def test_a_resumed_dpo_run_ends_with_the_uninterrupted_runs_weights(dpo_run, tmp_path):
    """Killed right after its step-40 checkpoint and resumed: the reference comes from the starting
    model again (not the checkpoint's), so the last steps are the same."""
    run = tmp_path / "run"
    shutil.copytree(dpo_run / "checkpoints" / "step_40", run / "checkpoints" / "step_40")
    lines = (dpo_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if '"checkpoint"' in line and '"step": 40' in line)
    (run / "metrics.jsonl").write_text("".join(lines[: cut + 1]))
    run_zero2(run, [*DPO, *STEPS, "--resume_from_checkpoint", "latest"])
    assert [e["resumed_at"] for e in events(run) if e["event"] == "start"] == [0, 40]
    assert len([e for e in events(run) if e["event"] == "eval" and e.get("start")]) == 1  # not evaluated again
    want, got = (load_file(r / "final" / "model.safetensors") for r in (dpo_run, run))
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-5
    results = json.loads((run / "all_results.json").read_text())
    assert results["start_eval_bleu"] == json.loads((dpo_run / "all_results.json").read_text())["start_eval_bleu"]


def test_dpo_with_a_lora_adapter_learns_the_preferences_and_its_bleu_drop_is_reported(tmp_path):
    """LoRA on the same set at the setting measured best (r 16, alpha 32, 4e-4: over 7 seeds on one
    GPU, +43 to +47 points of accuracy every time, BLEU -1.2 to -4.0, within 2 points in 3 of 7;
    docs/benchmarks.md): the accuracy is asserted, the BLEU drop is reported and flagged exactly
    when it passes 2 points (which side of 2 a seed lands on is noise of 187 rows)."""
    lora = ["--adapter", "lora", "--lora_r", "16", "--lora_alpha", "32", "--learning_rate", "4e-4"]
    out = run_zero2(tmp_path / "run", [*DPO, "--max_train_steps", "70", *lora])
    start, end = start_and_end(out)
    assert end["eval_pref_accuracy"] >= start["eval_pref_accuracy"] + 0.40, (start, end)
    assert (out / "final" / "adapter_model.safetensors").is_file()
    results = json.loads((out / "all_results.json").read_text())
    assert results["bleu_drop"] == pytest.approx(start["eval_bleu"] - end["eval_bleu"])
    assert results["bleu_drop_flag"] is (results["bleu_drop"] > 2)
    flagged = "(fell more than 2 points: flagged)" in (out / "final" / "README.md").read_text()
    assert flagged is results["bleu_drop_flag"]


def test_kto_raises_the_share_of_replies_it_rates_right(tmp_path):
    files = {}
    for split in ("train", "validation"):
        rows = kto_rows(read_rows(SAMPLE_DIR / f"preferences-{split}.jsonl"))
        files[split] = tmp_path / f"kto-{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run_zero2(
        tmp_path / "run",
        ["--objective", "kto", "--preference_file", str(files["train"])]
        + ["--preference_validation_file", str(files["validation"]), "--max_train_steps", "70"]
        + ["--learning_rate", "6e-5"],
    )
    start, end = start_and_end(out)
    assert start["eval_pref_rows"] == 236 and start["eval_pref_accuracy"] == 0.0  # (no reward yet: ties)
    assert end["eval_pref_accuracy"] >= 0.5, end
    assert json.loads((out / "all_results.json").read_text())["objective"] == "kto"


@pytest.mark.parametrize(
    ("rows", "objective", "message"),
    [
        ([{"texts": "hi", "chosen": "yes", "rejected": "yes"}], "dpo", "row 1: 'chosen' and 'rejected' are the same"),
        ([{"texts": "hi", "response": "yes", "label": True}], "dpo", "are KTO rows .*: use --objective kto"),
        ([{"texts": "hi", "response": "yes", "label": True}, {"texts": "hi", "response": "no", "label": "maybe"}],
         "kto", "row 2: 'label' must be true or false"),
    ],
)  # fmt: skip
def test_a_bad_preference_file_fails_before_training_naming_it(rows, objective, message, tmp_path):
    bad = tmp_path / "prefs.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    proc = launch(["--output_dir", str(out), "--objective", objective, "--preference_file", str(bad)])
    assert proc.returncode == 1
    (error,) = errors(out)
    assert error["kind"] == "DataError" and error["file"] == str(bad)
    assert error["message"].startswith(f"{bad}: ") and re.search(message, error["message"]), error
    assert [e["event"] for e in events(out)] == ["error"]  # nothing else: the same command runs again once fixed
