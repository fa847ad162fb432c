"""Real training runs on CPU: DeepSpeed ZeRO-2 over 2 processes, resume, two loopback machines,
Hub push failure. Each run uses the tiny preset on the shipped sample data."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from chat.layout import ROOT

FAST = ["--model_name_or_path", "tiny", "--dataset_name", "sample", "--n_val", "16", "--num_beams", "2",
        "--val_min_target_length", "2", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8",
        "--learning_rate", "1e-3", "--logging_steps", "2", "--seed", "7"]


def launch(args, *, launcher=(), env=None, timeout=300) -> subprocess.CompletedProcess:
    cmd = [*launcher, "-m", "finetune", *FAST, *args] if launcher else [sys.executable, "-m", "finetune", *FAST, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def accelerate(*flags):
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_zero2.yaml", *flags]


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def zero2_run(tiny_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("zero2") / "run"
    proc = launch(["--output_dir", str(out), "--max_train_steps", "12", "--checkpointing_steps", "4"],
                  launcher=accelerate("--main_process_port", str(free_port())))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc


def test_zero2_two_processes_trains_and_saves(zero2_run):
    out, _ = zero2_run
    ev = events(out)
    start = ev[0]
    assert start["event"] == "start"
    assert start["distributed"] == "DEEPSPEED" and start["zero_stage"] == 2 and start["num_processes"] == 2
    logs = [e for e in ev if e["event"] == "log"]
    assert logs[-1]["step"] == 12
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.3, [e["loss"] for e in logs]
    assert all(e["samples_per_second"] > 0 and e["lr"] >= 0 for e in logs)
    results = json.loads((out / "all_results.json").read_text())
    assert 0.0 <= results["eval_bleu"] <= 100.0 and results["eval_samples"] == 16
    assert len(results["train_epoch_seconds"]) == 1 and len(results["eval_epoch_seconds"]) == 1
    assert ev[-1]["event"] == "done"

    from transformers import AutoTokenizer, BlenderbotForConditionalGeneration

    final = out / "final"
    assert (final / "model.safetensors").is_file() and not list(final.glob("*.bin"))
    model = BlenderbotForConditionalGeneration.from_pretrained(final, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(final)
    args = json.loads((final / "training_args.json").read_text())
    assert args["source_prefix"] == "chatbot: " and args["max_source_length"] == 128
    ids = tok(args["source_prefix"] + "context: happy  <s> i got a new puppy!", return_tensors="pt")
    reply = model.generate(**ids, max_new_tokens=8, num_beams=1)
    assert reply.shape[1] > 1
    assert "eval_bleu" in json.loads((final / "all_results.json").read_text())
    card = (final / "README.md").read_text()
    assert card.startswith("---") and "sacreBLEU" in card and "`tiny`" in card
    # keep-last-2 policy: step_4 was pruned once step_8 and step_12 existed
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_12", "step_8"]


def test_resume_matches_uninterrupted_run(zero2_run, tmp_path):
    """Resuming from the step-8 checkpoint reproduces the uninterrupted run's final weights."""
    out, _ = zero2_run
    resumed = tmp_path / "resumed"
    proc = launch(["--output_dir", str(resumed), "--max_train_steps", "12",
                   "--resume_from_checkpoint", str(out / "checkpoints" / "step_8")],
                  launcher=accelerate("--main_process_port", str(free_port())))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert events(resumed)[0]["resumed_at"] == 8
    reference = load_file(out / "final" / "model.safetensors")
    got = load_file(resumed / "final" / "model.safetensors")
    assert reference.keys() == got.keys()
    worst = max((reference[k] - got[k]).abs().max().item() for k in reference)
    assert worst < 1e-5, worst
    # it trained only the remaining steps (the first one is always logged)
    assert [e["step"] for e in events(resumed) if e["event"] == "log"] == [9, 10, 12]


def test_stop_file_checkpoints_and_resume_latest(tiny_path, tmp_path):
    """A STOP file makes the run save a checkpoint and exit; `latest` continues it to the end."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "STOP").touch()
    proc = launch(["--output_dir", str(out), "--max_train_steps", "6"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ev = events(out)
    assert ev[-1] == {**ev[-1], "event": "stopped", "step": 1}
    assert (out / "checkpoints" / "step_1").is_dir() and not (out / "final").exists()
    (out / "STOP").unlink()
    proc = launch(["--output_dir", str(out), "--max_train_steps", "6", "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ev = events(out)
    assert ev[-1]["event"] == "done" and ev[-1]["step"] == 6
    assert (out / "final" / "model.safetensors").is_file()


def test_refuses_to_overwrite_a_previous_run(zero2_run):
    out, _ = zero2_run
    before = (out / "metrics.jsonl").read_text()
    proc = launch(["--output_dir", str(out), "--max_train_steps", "2"])
    assert proc.returncode == 1
    assert "already holds a run" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before


def test_two_loopback_machines_train_together(tiny_path, tmp_path):
    out = tmp_path / "multinode"
    port = str(free_port())
    procs = []
    for rank in ("0", "1"):
        launcher = accelerate("--num_machines", "2", "--num_processes", "2", "--machine_rank", rank,
                              "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                              "--deepspeed_multinode_launcher", "standard")
        cmd = [*launcher, "-m", "finetune", *FAST, "--output_dir", str(out), "--max_train_steps", "4"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    start = events(out)[0]
    assert start["num_processes"] == 2 and start["zero_stage"] == 2
    assert events(out)[-1]["event"] == "done"


def test_push_failure_is_clear_and_token_never_leaks(tiny_path, tmp_path):
    token = "hf_NotARealTokenButSecret1234567890"
    out = tmp_path / "push"
    proc = launch(["--output_dir", str(out), "--max_train_steps", "2", "--push_to_hub", "--hub_model_id", "someone/chat",
                   "--with_tracking", "--report_to", "tensorboard"], env={"HF_TOKEN": token})
    assert proc.returncode == 1
    assert "could not push" in proc.stderr and "intact" in proc.stderr
    assert (out / "final" / "model.safetensors").is_file()  # the local checkpoint survives
    assert token not in proc.stdout + proc.stderr
    assert list(out.rglob("events.out.tfevents.*")), "the tensorboard tracker wrote nothing"
    for file in out.rglob("*"):
        if file.is_file():
            assert token.encode() not in file.read_bytes(), file


def test_non_finite_loss_stops_the_run(tiny_path, tmp_path):
    out = tmp_path / "diverge"
    proc = launch(["--output_dir", str(out), "--max_train_steps", "20", "--learning_rate", "1e30"])
    assert proc.returncode == 1
    assert "loss was not finite" in proc.stderr
    assert events(out)[-1]["event"] == "error"
    assert not (out / "final").exists()


def test_length_grouped_run_resumes_exactly(tiny_path, tmp_path):
    """--group_by_length's order is a function of seed and epoch: a run resumed mid-epoch ends
    with the same weights as an uninterrupted one."""
    flags = ["--group_by_length", "--n_train", "64", "--per_device_train_batch_size", "4", "--max_train_steps", "12"]
    full = tmp_path / "full"
    proc = launch([*flags, "--output_dir", str(full), "--checkpointing_steps", "3", "--checkpoints_total_limit", "10"],
                  launcher=accelerate("--main_process_port", str(free_port())))
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = tmp_path / "resumed"
    proc = launch([*flags, "--output_dir", str(resumed), "--resume_from_checkpoint", str(full / "checkpoints" / "step_3")],
                  launcher=accelerate("--main_process_port", str(free_port())))
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = load_file(full / "final" / "model.safetensors")
    got = load_file(resumed / "final" / "model.safetensors")
    assert max((reference[k] - got[k]).abs().max().item() for k in reference) < 1e-5


def test_unwritable_profile_dir_fails_before_training(tmp_path):
    from finetune.train import TrainingError, start_profiler

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(TrainingError, match="--profile_dir .*cannot write there"):
        start_profiler(str(blocker / "profile"))
    profiler = start_profiler(str(tmp_path / "profile"))  # a writable folder starts a profiler
    profiler.stop()
    assert (tmp_path / "profile").is_dir() and not list((tmp_path / "profile").iterdir())
