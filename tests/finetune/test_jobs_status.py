"""finetune/jobs/status.py: a failed run's reason comes from the CLI's error events first (kind,
message, file), and from train.log only when the attempt wrote none (any rank's lines)."""

import json
import time

import pytest

from chat.layout import ROOT
from finetune import checkpoint as ckpt
from finetune.jobs.manager import RunManager
from finetune.jobs.status import _eta, error_from_event, error_from_log, status_of

RUN_ID = "20250101-000000-abcdef"


def failed_run(root, events=(), log="", earlier_events=(), earlier_log="", exit_code=1):
    """A run folder whose process is gone: an earlier attempt (events, log), then the current one."""
    run_dir = root / RUN_ID
    run_dir.mkdir(parents=True)
    metrics = ckpt.MetricsWriter(run_dir, enabled=True)
    for event in earlier_events:
        metrics.write(**event)
    (run_dir / "train.log").write_text(earlier_log)
    info = {
        "run_id": RUN_ID,
        "spec": {},
        "argv": ["python", "-m", "finetune"],
        "pid": None,
        "pgid": None,
        "metrics_offset": (run_dir / "metrics.jsonl").stat().st_size if earlier_events else 0,
        "log_offset": len(earlier_log.encode()),
        "exit_code": exit_code,
        "attempts": [],
    }
    (run_dir / "run.json").write_text(json.dumps(info))
    for event in events:
        metrics.write(**event)
    with open(run_dir / "train.log", "a") as fh:
        fh.write(log)
    return run_dir


CLI_LOG = "12:00:01 INFO finetune: loading\n12:00:02 ERROR finetune: the log's message\n"


def test_the_latest_error_event_is_the_reason(tmp_path):
    run_dir = failed_run(
        tmp_path,
        log=CLI_LOG,
        events=[
            {"event": "start", "total_steps": 10, "resumed_at": 0},
            {"event": "error", "step": 3, "message": "CUDA out of memory"},  # as older CLIs wrote it where it happened
            {
                "event": "error",
                "kind": "TrainingError",
                "message": "CUDA out of memory at batch 64: try a smaller one",
                "file": None,
                "step": 3,
            },
        ],
    )  # main()'s event for the failure
    status = status_of(run_dir)
    assert status.state == "failed" and status.error == "CUDA out of memory at batch 64: try a smaller one"


def test_an_error_event_names_the_file_and_an_internal_kind(tmp_path):
    event = {
        "event": "error",
        "kind": "DataError",
        "message": "row 3: column 'labels' is empty",
        "file": "/up/train.jsonl",
    }
    assert status_of(failed_run(tmp_path / "a", [event], CLI_LOG)).error == (
        "row 3: column 'labels' is empty (file: /up/train.jsonl)"
    )
    named = dict(event, message="/up/train.jsonl: row 3: column 'labels' is empty")
    assert status_of(failed_run(tmp_path / "b", [named])).error == named["message"]  # not twice
    internal = {"event": "error", "kind": "internal", "message": "KeyError: 'input_ids'", "file": None}
    assert status_of(failed_run(tmp_path / "c", [internal])).error == "internal error: KeyError: 'input_ids'"
    assert error_from_event({"event": "error", "kind": "HubError", "message": "could not push"}) == "could not push"
    inside = f"saving {ROOT}/runs/x/final failed: cannot write {ROOT}/runs/x/.final.tmp: File too large (EFBIG)"
    shown = error_from_event(
        {"event": "error", "kind": "TrainingError", "message": inside, "file": f"{ROOT}/runs/x/final"}
    )
    assert shown == "saving runs/x/final failed: cannot write runs/x/.final.tmp: File too large (EFBIG)"
    assert error_from_event({"event": "error", "kind": "DataError", "message": " "}) is None


def test_the_log_is_the_fallback_for_this_attempt_only(tmp_path):
    old = {"event": "error", "kind": "DataError", "message": "the earlier attempt's error", "file": None}
    run_dir = failed_run(
        tmp_path,
        earlier_events=[old],
        earlier_log="12:00:00 ERROR finetune: earlier\n",
        events=[{"event": "start", "total_steps": 10, "resumed_at": 4}],
        log=CLI_LOG,
    )
    assert status_of(run_dir).error == "the log's message"
    # no event and nothing recognisable in the log: the exit code
    assert status_of(failed_run(tmp_path / "b", log="Killed\n", exit_code=-9)).error == (
        "the training process exited with code -9; see the log"
    )
    assert "ended without a result" in status_of(failed_run(tmp_path / "c", exit_code=None)).error


def test_an_error_event_of_a_push_after_done_keeps_the_run_finished(tmp_path):
    failed_run(
        tmp_path,
        events=[
            {"event": "done", "step": 4, "eval_bleu": 1.0},
            {"event": "error", "message": "could not push (offline)"},
            {"event": "error", "kind": "HubError", "message": "could not push: 401", "file": None},
        ],
    )
    status = RunManager(tmp_path).status(RUN_ID)
    assert status.state == "finished" and status.error == "could not push: 401"


@pytest.mark.parametrize(
    "lines,reason",
    [
        (["12:00:02 ERROR finetune: bad data"], "bad data"),
        (["[rank0]: 12:00:02 ERROR finetune.train: bad data"], "bad data"),
        (["usage: ...", "python -m finetune: error: --n_train must be >= 1, got 0"], "--n_train must be >= 1, got 0"),
        (["[rank1]: python -m finetune: error: unknown flag"], "unknown flag"),
        (
            [
                "Traceback (most recent call last):",
                '  File "x.py", line 1',
                "RuntimeError: boom",
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: finetune FAILED",
                "subprocess.CalledProcessError: Command '...' returned non-zero exit status 1.",
            ],
            "RuntimeError: boom",
        ),
        (
            [
                "[rank0]: Traceback (most recent call last):",
                '[rank0]:   File "x.py", line 1',
                "[rank0]: torch.OutOfMemoryError: CUDA out of memory.",
                "[rank1]:[W101 12:00:00] warning",
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
            ],
            "torch.OutOfMemoryError: CUDA out of memory.",
        ),
        (["[rank1]:   ValueError: deep inside"], "ValueError: deep inside"),
        (["all good", "[rank0]: still good"], None),
    ],
)
def test_error_from_log(lines, reason):
    assert error_from_log(lines) == reason


# --------------------------------------------------------------------------- what visitors may see

SAMPLES = [{"prompt": "chatbot: my card is 4111", "prediction": "ok", "reference": "noted"}]
SAMPLE_LOG = (
    "12:00:03 INFO finetune.train: prompt: 'chatbot: my card is 4111' | prediction: 'ok' | "
    "reference: 'noted'\n12:00:04 INFO finetune.train: epoch 0: BLEU 1.00\n"
)


@pytest.mark.parametrize(
    "spec,private",
    [
        ({"config": {"dataset_name": "sample"}, "split_train_file": None}, False),
        ({"config": {"dataset_name": "smangrul/MuDoConv"}, "split_train_file": None}, False),
        ({"config": {"dataset_name": "sample"}, "split_train_file": "/data/uploads/mine.jsonl"}, True),  # an upload
        ({"config": {"dataset_name": "sample", "train_file": "/up/t.jsonl", "validation_file": "/up/v.jsonl"}}, True),
        ({"config": {"dataset_name": "someone/private-chats"}, "split_train_file": None}, True),  # the Space's token
        ({"model": "tiny", "dataset": "sample"}, False),  # the flat RunSpec of older run folders
        ({"model": "tiny", "dataset": "/data/uploads/mine.jsonl"}, True),
        ({}, True),  # unreadable: private
    ],
)
def test_samples_of_runs_on_uploaded_data_are_private(tmp_path, spec, private):
    run_dir = failed_run(
        tmp_path,
        log=SAMPLE_LOG,
        events=[{"event": "eval", "step": 4, "eval_bleu": 1.0, "samples": SAMPLES}, {"event": "done", "step": 4}],
    )
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "spec": spec}))
    status = status_of(run_dir)
    assert status.state == "finished" and status.samples == SAMPLES and "4111" in status.log_tail  # logged in
    assert status.samples_private is private
    seen = status.for_visitor()  # what the web UI shows a visitor who is not logged in
    assert (seen.samples, "4111" in seen.log_tail) == (([], False) if private else (SAMPLES, True))
    assert "epoch 0: BLEU 1.00" in seen.log_tail and status.samples == SAMPLES  # the status itself is unchanged


def test_bleu_by_kind_and_on_held_out_feedback_come_from_the_latest_evaluation(tmp_path):
    parts = {"eval_bleu_persona": 30.5, "eval_bleu_none": 12.0, "eval_bleu_feedback": 8.25, "eval_rows_persona": 9}
    run_dir = failed_run(
        tmp_path,
        events=[
            {"event": "eval", "step": 2, "eval_bleu": 0.5, "eval_bleu_persona": 1.0},
            {"event": "eval", "step": 4, "eval_bleu": 1.0, **parts},
            {"event": "done", "step": 4},
        ],
    )
    status = status_of(run_dir)
    assert status.bleu_parts == {"persona": 30.5, "none": 12.0, "feedback": 8.25}  # rows counts are not BLEU
    assert status.for_visitor().bleu_parts == status.bleu_parts


def test_a_partial_log_shows_the_run_alive_but_is_no_point_of_the_loss_curve(tmp_path):
    """The first step after a resume is logged ``partial``: its loss window, continued from the
    checkpoint, is still open. The curve leaves it out (it stays the uninterrupted run's); the
    step, the speed and the ETA of the attempt count it."""
    now = time.time()
    earlier = [
        {"event": "start", "time": now - 100, "total_steps": 20, "resumed_at": 0},
        {"event": "log", "time": now - 99, "step": 1, "loss": 7.5, "samples_per_second": 10.0},  # a fresh start's
        {"event": "log", "time": now - 90, "step": 5, "loss": 7.0, "samples_per_second": 20.0},
        {"event": "checkpoint", "step": 8, "path": "x"},
        {"event": "stopped", "step": 8},
    ]
    current = [
        {"event": "start", "time": now - 10, "total_steps": 20, "resumed_at": 8},
        {"event": "log", "time": now - 5, "step": 9, "loss": 6.9, "samples_per_second": 30.0, "partial": True},
    ]
    run_dir = failed_run(tmp_path, earlier_events=earlier, events=current)
    status = status_of(run_dir)
    assert status.loss_points == [{"step": 1, "loss": 7.5}, {"step": 5, "loss": 7.0}]
    assert status.step == 9 and status.samples_per_second == 30.0
    # 1 step in 5 s since the resume: 11 steps to go, 5 s of them gone since that log
    assert _eta(current, 9, 20) == pytest.approx(50.0, abs=1.0)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"event": "log", "time": now, "step": 10, "loss": 6.8, "samples_per_second": 40.0}) + "\n")
    status = status_of(run_dir)
    assert [p["step"] for p in status.loss_points] == [1, 5, 10] and status.samples_per_second == 40.0
