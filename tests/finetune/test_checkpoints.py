"""Checkpoints: saved once per step with a manifest, verified before a resume, skipped (latest) or
refused (a path) when corrupt, and final/ readable by the app. One real 2-process ZeRO-2 run
(`saved_run`) provides the checkpoints; the corruptions are applied to copies of them."""

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_train import FAST, accelerate, events, free_port, launch

from finetune import checkpoint as ckpt
from finetune.checkpoint import TrainingError

# 64 rows on 2 processes of 8 = 4 steps per epoch: every checkpoint step (4, 8, 12) also ends an epoch.
RUN = ["--n_train", "64", "--max_train_steps", "12", "--checkpointing_steps", "4", "--checkpoints_total_limit", "10"]
SHARD0 = "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt"
SHARD1 = "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "pytorch_model/mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def saved_run(tiny_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("checkpoints") / "run"
    proc = launch(["--output_dir", str(out), *RUN], launcher=accelerate("--main_process_port", str(free_port())))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def copy_checkpoints(run: Path, dest: Path, steps=(8, 12)) -> Path:
    """A run folder holding copies of some of ``run``'s checkpoints (and no metrics.jsonl)."""
    for step in steps:
        shutil.copytree(run / "checkpoints" / f"step_{step}", dest / "checkpoints" / f"step_{step}")
    return dest


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(data)


# name: (file, how it is corrupted, what the problem says)
CORRUPTIONS = {
    "truncated shard": (SHARD0, lambda f: os.truncate(f, f.stat().st_size // 2), "truncated: "),
    "zero-byte file": (MODEL, lambda f: os.truncate(f, 0), "empty (0 of "),
    "flipped bytes in a shard": (SHARD1, flip_bytes, "sha256 mismatch"),
    "missing file": ("scheduler.bin", Path.unlink, "missing"),
    "trainer_state garbage": ("trainer_state.json", lambda f: f.write_text("garbage{"), "not valid JSON"),
    "trainer_state without completed_steps": (
        "trainer_state.json",
        lambda f: f.write_text('{"epoch": 2}'),
        "has no completed_steps",
    ),
    "missing RNG state": (
        "random_states_1.pkl",
        Path.unlink,
        "missing (the RNG state of process 1: a resume from it would not be bit-identical)",
    ),
}


# --------------------------------------------------------------------------- what a run saves


def test_checkpoint_step_that_ends_an_epoch_is_saved_once(saved_run):
    """--checkpointing_steps equal to the steps per epoch used to save steps 4 and 8 twice."""
    ev = events(saved_run)
    assert ev[0]["steps_per_epoch"] == 4
    assert [e["step"] for e in ev if e["event"] == "checkpoint"] == [4, 8, 12]
    assert sorted(p.name for p in (saved_run / "checkpoints").iterdir()) == ["step_12", "step_4", "step_8"]


def test_manifest_lists_every_file_with_size_and_sha256(saved_run):
    folder = saved_run / "checkpoints" / "step_8"
    manifest = json.loads((folder / ckpt.MANIFEST_FILE).read_text())["files"]
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {ckpt.MANIFEST_FILE}
    assert set(manifest) == files and {SHARD0, SHARD1, MODEL, "random_states_1.pkl", "trainer_state.json"} <= files
    for rel, entry in manifest.items():
        assert entry == {"size": (folder / rel).stat().st_size, "sha256": ckpt.sha256(folder / rel)}
    state = json.loads((folder / ckpt.STATE_FILE).read_text())
    assert state["completed_steps"] == 8 and state["num_processes"] == 2
    assert state["loss_window"] == {"loss_sum": 0.0, "count": 0.0}  # step 8 was a log step: nothing open
    assert ckpt.check_checkpoint(folder, processes=2).intact


def test_final_files_are_readable_by_everyone(saved_run):
    """safetensors writes model.safetensors 0600; the app and a Space serve final/ (0644 like the rest)."""
    final = saved_run / "final"
    assert stat.S_IMODE(final.stat().st_mode) == 0o755
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in final.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


# --------------------------------------------------------------------------- corrupt checkpoints


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corrupt_checkpoint_is_skipped_by_latest_and_refused_by_path(name, saved_run, tmp_path, caplog):
    rel, corrupt, problem = CORRUPTIONS[name]
    out = copy_checkpoints(saved_run, tmp_path / "run")
    newest, older = out / "checkpoints" / "step_12", out / "checkpoints" / "step_8"
    corrupt(newest / rel)
    metrics = ckpt.MetricsWriter(out, enabled=True)

    with caplog.at_level(logging.WARNING, logger="finetune.checkpoint"):
        assert ckpt.choose_checkpoint(out, "latest", processes=2, metrics=metrics) == older
    [skipped] = events(out)
    assert skipped == {
        **skipped,
        "event": "checkpoint_skipped",
        "path": str(newest),
        "file": str(newest / rel),
        "resuming_from": str(older),
    }
    assert skipped["problems"][0].startswith(f"{rel}: ") and problem in skipped["problems"][0], skipped["problems"]
    assert f"skipping corrupt checkpoint {newest}: {newest / rel}: " in caplog.text
    assert f"resuming from {older} instead" in caplog.text

    # Named by path, it is an error naming the file: no silent fallback.
    with pytest.raises(TrainingError, match=f"checkpoint {newest} is corrupt: {newest / rel}: ") as info:
        ckpt.choose_checkpoint(out, str(newest), processes=2, metrics=metrics)
    assert info.value.file == str(newest / rel) and problem in str(info.value)
    assert "delete this one" in str(info.value)


def test_no_intact_checkpoint_is_one_clear_error_naming_the_files(saved_run, tmp_path):
    from finetune.cli import main

    out = copy_checkpoints(saved_run, tmp_path / "run")
    (out / "checkpoints" / "step_8" / "trainer_state.json").write_text("garbage{")
    os.truncate(out / "checkpoints" / "step_12" / SHARD0, 1000)
    assert main([*FAST, *RUN, "--output_dir", str(out), "--resume_from_checkpoint", "latest"]) == 1
    [error] = events(out)  # fails before loading anything
    assert error == {**error, "event": "error", "kind": "TrainingError", "file": str(out / "checkpoints")}
    assert error["message"].startswith(f"no intact checkpoint to resume from in {out / 'checkpoints'}: ")
    assert str(out / "checkpoints" / "step_8" / "trainer_state.json") in error["message"]
    assert str(out / "checkpoints" / "step_12" / SHARD0) in error["message"]


def test_checkpoint_without_manifest_loads_with_a_warning_but_its_rng_states_are_checked(saved_run, tmp_path, caplog):
    """Checkpoints saved before manifests: still resumable (unverified), but a missing or damaged
    RNG state (accelerate would skip it silently and the run would differ) makes them corrupt."""
    out = copy_checkpoints(saved_run, tmp_path / "run")
    newest = out / "checkpoints" / "step_12"
    for step in (8, 12):
        (out / "checkpoints" / f"step_{step}" / ckpt.MANIFEST_FILE).unlink()
    metrics = ckpt.MetricsWriter(out, enabled=True)
    with caplog.at_level(logging.WARNING, logger="finetune.checkpoint"):
        assert ckpt.choose_checkpoint(out, "latest", processes=2, metrics=metrics) == newest
    assert events(out)[-1] == {**events(out)[-1], "event": "checkpoint_unverified", "path": str(newest)}
    assert "cannot be verified" in caplog.text

    flip_bytes(newest / "random_states_0.pkl")
    verdict = ckpt.check_checkpoint(newest, processes=2)
    problem = (
        "unreadable (not an intact torch.save file) (the RNG state of process 0: a resume from it would not "
        "be bit-identical)"
    )
    assert verdict.problems == [("random_states_0.pkl", problem)]
    (newest / "random_states_0.pkl").unlink()
    assert ckpt.choose_checkpoint(out, "latest", processes=2, metrics=metrics) == out / "checkpoints" / "step_8"
    assert [e["event"] for e in events(out)][-2:] == ["checkpoint_skipped", "checkpoint_unverified"]


@pytest.mark.parametrize("processes", [1, 4])
def test_resume_on_another_process_count_is_recorded_as_not_identical(processes, saved_run, tmp_path):
    out = copy_checkpoints(saved_run, tmp_path / "run", steps=(12,))
    newest = out / "checkpoints" / "step_12"
    assert ckpt.choose_checkpoint(out, "latest", processes=processes, metrics=ckpt.MetricsWriter(out, True)) == newest
    [note] = events(out)
    assert note == {**note, "event": "resume_not_identical", "path": str(newest)}
    assert note["reason"].startswith(f"saved by 2 processes, resumed on {processes}:")


def test_resume_latest_falls_back_past_a_corrupt_checkpoint_and_reproduces_the_run(saved_run, tmp_path):
    """Flipped bytes in the newest optimizer shard used to load and end in a non-finite loss; now
    the resume skips that checkpoint, loads the older one (saved before manifests and loss
    windows: unverified, and its first step after the resume is a point of the curve, as before)
    and ends with the uninterrupted run's weights."""
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    flip_bytes(out / "checkpoints" / "step_12" / SHARD1)
    older = out / "checkpoints" / "step_8"
    (older / ckpt.MANIFEST_FILE).unlink()
    state = json.loads((older / ckpt.STATE_FILE).read_text())
    (older / ckpt.STATE_FILE).write_text(json.dumps({k: v for k, v in state.items() if k != "loss_window"}))
    before = len(events(out))
    proc = launch(
        ["--output_dir", str(out), *RUN, "--resume_from_checkpoint", "latest"],
        launcher=accelerate("--main_process_port", str(free_port())),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    new = events(out)[before:]
    assert [e["event"] for e in new][:3] == ["checkpoint_skipped", "checkpoint_unverified", "start"]
    assert new[0]["file"] == str(out / "checkpoints" / "step_12" / SHARD1)
    assert new[2]["resumed_at"] == 8 and new[-1]["event"] == "done"
    assert [(e["step"], e.get("partial")) for e in new if e["event"] == "log"] == [(9, None), (10, None), (12, None)]
    assert f"skipping corrupt checkpoint {out / 'checkpoints' / 'step_12'}" in proc.stderr
    reference = load_file(saved_run / "final" / "model.safetensors")
    got = load_file(out / "final" / "model.safetensors")
    assert max((reference[k] - got[k]).abs().max().item() for k in reference) < 1e-5
    assert ckpt.check_checkpoint(out / "checkpoints" / "step_12", processes=2).intact  # saved again, intact


def test_saved_window_reads_a_checkpoints_open_loss_window():
    assert ckpt.saved_window({"completed_steps": 8, "loss_window": {"loss_sum": 20.5, "count": 3}}) == (20.5, 3.0)
    for state in (
        {"completed_steps": 8},  # saved before checkpoints kept it
        {"loss_window": None},
        {"loss_window": {"loss_sum": 1.0}},
        {"loss_window": {"loss_sum": "x", "count": 1}},
        {"loss_window": {"loss_sum": float("nan"), "count": 1}},
        {"loss_window": {"loss_sum": 1.0, "count": -1}},
    ):
        assert ckpt.saved_window(state) is None, state
