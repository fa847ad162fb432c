"""The Train tab's logic (webui/train_handlers.py), without a browser; the login rules are in test_auth.py.

Real RunManager, real files; runs that would launch are refused before launching (no login) or
are the fake-process kind of tests/finetune/test_jobs_process.py. Real training through the app is in
tests/webui/test_app_train.py and tests/webui/test_browser.py."""

import dataclasses
import json
import os
import re
import shlex
import threading
import time
from pathlib import Path

import gradio as gr
import pandas as pd
import pytest
from gradio.data_classes import FileData
from hostile_files import parquet_bomb
from write_faults import read_only

from chat.engine import DEFAULT_MODEL, DEMO_DIR
from finetune import checkpoint as ckpt
from finetune import memory
from finetune.config import TrainConfig, parse_args
from finetune.jobs import paths
from finetune.jobs import uploads as jobs_uploads
from finetune.jobs.manager import RunManager
from finetune.jobs.spec import JobSpec, app_config
from finetune.jobs.status import RunStatus
from webui import train_handlers, train_preflight, train_view, train_words
from webui import uploads as webui_uploads
from webui.auth import AuthConfig

PASSWORD = "correct horse battery staple"


@pytest.fixture
def tab(tmp_path, monkeypatch):
    """A Train tab on its own runs root, data root and incoming folder, password configured."""
    data = tmp_path / "uploads"
    monkeypatch.setenv("PERSONA_CHAT_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(data))
    (tmp_path / "incoming").mkdir()
    return train_handlers.TrainTab(
        manager=RunManager(tmp_path / "runs"),
        auth=AuthConfig(password=PASSWORD),
        gpus=0,
        data_root=data,
        incoming=tmp_path / "incoming",
    )


def logged_in(tab) -> str:
    """A live login token of the tab's server (what the browser sends after a right password)."""
    return tab.auth.logins.issue()


def form(tab, **changes) -> dict:
    """The form's values (FORM_FIELDS name -> value), as the tab hands them to a handler."""
    values = {**train_handlers.default_form(tab), **changes}
    assert set(values) == set(train_handlers.FORM_FIELDS)
    return values


def write_rows(path: Path, n: int) -> Path:
    path.write_text(
        "".join(
            json.dumps({"texts": f"context: happy  <s> hello number {i}", "labels": f"hi {i}!"}) + "\n"
            for i in range(n)
        )
    )
    return path


# --------------------------------------------------------------------------- the form


def test_default_form_is_a_valid_tiny_cpu_run(tab):
    values = train_handlers.default_form(tab)
    assert set(values) == set(train_handlers.FORM_FIELDS)
    assert values["model_name_or_path"] == "tiny" and values["num_gpus"] == 0 and values["learning_rate"] == 1e-3
    assert (
        values["num_train_epochs"],
        values["per_device_train_batch_size"],
        values["per_device_eval_batch_size"],
        values["num_beams"],
        values["logging_steps"],
    ) == (3, "auto", 32, 4, 10)  # the app's preset: the train batch picks itself
    spec = train_handlers.spec_from_form(tab, form(tab), None)
    assert spec == JobSpec(app_config("tiny", dataset_name="sample"))
    gpu_tab = train_handlers.TrainTab(manager=tab.manager, auth=tab.auth, gpus=2)
    assert train_handlers.default_form(gpu_tab)["model_name_or_path"] == DEFAULT_MODEL
    assert train_handlers.default_form(gpu_tab)["learning_rate"] == TrainConfig().learning_rate == 5e-5
    assert train_handlers.default_form(gpu_tab)["num_gpus"] == 2
    assert train_handlers.learning_rate_for("tiny") == 1e-3 and train_handlers.learning_rate_for(DEFAULT_MODEL) == 5e-5


def test_spec_from_form_maps_every_field(tab):
    values = form(
        tab,
        data_source="hub",
        hub_dataset="smangrul/MuDoConv",
        n_train=100.0,
        n_val=0,
        num_train_epochs=2.0,
        learning_rate=3e-4,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        max_source_length=64,
        max_target_length=16,
        source_prefix="",
        checkpointing_steps=5,
        logging_steps=2,
        num_beams=1,
        push_to_hub=True,
        hub_model_id=" me/chat ",
        hub_private=True,
    )
    spec = train_handlers.spec_from_form(tab, values, None)
    config = TrainConfig(
        model_name_or_path="tiny",
        dataset_name="smangrul/MuDoConv",
        n_train=100,
        n_val=None,
        num_train_epochs=2,
        learning_rate=3e-4,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        max_source_length=64,
        max_target_length=16,
        val_min_target_length=16,
        source_prefix="",
        checkpointing_steps=5,
        logging_steps=2,
        num_beams=1,
        push_to_hub=True,
        hub_model_id="me/chat",
        hub_private=True,
    )
    assert spec == JobSpec(config, strategy="zero2", precision="auto", num_gpus=0)
    # every form field is a TrainConfig or JobSpec field, or says where the data comes from
    names = {f.name for f in dataclasses.fields(TrainConfig)} | {f.name for f in dataclasses.fields(JobSpec)}
    assert set(train_handlers.FORM_FIELDS) - names == set(train_handlers.DATA_FIELDS) - {"feedback_ratio"}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"data_source": "ftp"}, "data source must be one of"),
        ({"data_source": "upload"}, "upload a training file first"),
        ({"data_source": "hub", "hub_dataset": " "}, "type a Hub dataset id"),
        ({"data_source": "hub", "hub_dataset": "/etc/passwd"}, "not 'sample' or a Hub dataset id.*upload it"),
        ({"data_source": "hub", "hub_dataset": "../../etc"}, "not 'sample' or a Hub dataset id.*upload it"),
        # datasets' loader names read the server's files (issue 28): the box says to upload instead
        (
            {"data_source": "hub", "hub_dataset": "json"},
            "'json' is one of the datasets library's built-in loaders.*upload",
        ),
        ({"data_source": "hub", "hub_dataset": "text"}, "built-in loaders, which read local files.*upload it"),
        ({"data_source": "hub", "hub_dataset": "hf://datasets/csv"}, "not 'sample' or a Hub dataset id.*upload it"),
        ({"model_name_or_path": "/etc"}, "outside the allowed folders"),
        ({"model_name_or_path": ""}, "model is required"),
        ({"model_name_or_path": DEFAULT_MODEL}, "needs a GPU .* choose a LoRA adapter, the `tiny` model"),
        ({"model_name_or_path": "random-400M"}, "needs a GPU"),
        ({"num_gpus": 1}, r"1 GPU\(s\) asked for, 0 visible"),
        ({"strategy": "ddp"}, "needs GPUs"),
        ({"precision": "fp16"}, "needs GPUs"),
        ({"num_train_epochs": 0}, "num_train_epochs must be >= 1"),
        ({"num_train_epochs": 1.5}, "whole number"),
        ({"learning_rate": None}, "learning_rate is required"),
        ({"push_to_hub": True}, "push_to_hub needs --hub_model_id"),
        ({"hub_model_id": "not a repo"}, "user/name"),
    ],
)
def test_spec_from_form_refuses_with_a_clear_message(tab, changes, message):
    with pytest.raises(ValueError, match=message):
        train_handlers.spec_from_form(tab, form(tab, **changes), None)


def test_the_form_needs_every_field_and_no_other(tab):
    values = form(tab)
    with pytest.raises(ValueError, match="missing: num_beams, unknown: -"):
        train_handlers.spec_from_form(tab, {k: v for k, v in values.items() if k != "num_beams"}, None)
    with pytest.raises(ValueError, match="missing: -, unknown: seed"):
        train_handlers.spec_from_form(tab, {**values, "seed": 1}, None)
    with pytest.raises(ValueError, match="components must be named"):
        train_handlers.form_inputs({"model_name_or_path": object()})
    reordered = dict(reversed(list(values.items())))
    assert list(train_handlers.form_inputs(reordered)) == list(train_handlers.FORM_FIELDS)


def test_show_command_is_the_run_managers_command_and_needs_no_login(tab):
    values = form(tab, n_train=50, num_train_epochs=1)
    shown = train_handlers.show_command(tab, None, values)
    spec = train_handlers.spec_from_form(tab, values, None)
    expected = tab.manager.command_preview(spec)
    port = "--main_process_port"

    def strip(text):  # the port is fresh each time
        return [w for w in shlex.split(text) if not w.isdigit()]

    command = " ".join(line.removesuffix("\\") for line in shown.splitlines() if not line.startswith("#"))
    assert strip(command) == strip(expected) and port in shown  # the same command, one flag a line
    assert "\n  -m finetune \\\n  --model_name_or_path tiny \\\n  --dataset_name sample \\" in shown
    # The exact full command: every setting the run uses is a flag, the defaults too (the CLI's
    # num_beams 10 and val_min_target_length 20 were not shown), and what is left unset is said.
    cfg = parse_args(shlex.split(command)[shlex.split(command).index("finetune") + 1 :])
    assert cfg == dataclasses.replace(spec.config, output_dir=cfg.output_dir)
    for f in dataclasses.fields(TrainConfig):
        given = f"--{f.name} " in command or command.rstrip().endswith(f"--{f.name}") or f"--{f.name}=" in command
        assert given == (getattr(spec.config, f.name) is not None or f.name == "output_dir"), f.name
    assert "--val_min_target_length 20" in command and "--no_repeat_ngram_size 3" in command
    unset = next(line for line in shown.splitlines() if line.startswith("# left unset"))
    assert "n_val" in unset and "max_train_steps" in unset and "resume_from_checkpoint" not in unset
    # A form that describes no valid run: the reason, in the command box itself (not a bare "Error" badge).
    refused = train_handlers.show_command(tab, None, form(tab, data_source="upload"))
    assert refused.startswith("# no command: ") and "upload a training file first" in refused
    on_cpu = train_handlers.show_command(tab, None, form(tab, model_name_or_path=DEFAULT_MODEL))
    assert on_cpu.startswith("# no command: ") and "needs a GPU" in on_cpu


def test_plots_get_numeric_frames_even_when_empty():
    """An empty frame of object columns made gradio draw category axes (a falling loss drawn rising)."""
    for frame in (train_view.loss_frame(RunStatus()), train_view.bleu_frame(RunStatus())):
        assert frame.empty and all(str(t) in ("int64", "float64") for t in frame.dtypes)
    status = RunStatus(
        loss_points=[{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2}], bleu_points=[{"step": 2, "bleu": 3}]
    )
    assert list(train_view.loss_frame(status).dtypes.astype(str)) == ["int64", "float64"]
    assert train_view.bleu_frame(status)["bleu"].tolist() == [3.0]


def test_no_eta_counts_down_while_stopping():
    status = RunStatus(run_id="r", state="stopping", step=3, total_steps=10, progress=0.3, eta_seconds=42.0)
    assert "ETA" not in train_view.run_markdown(status)
    assert "ETA 42 s" in train_view.run_markdown(dataclasses.replace(status, state="running"))


def test_run_markdown_says_what_a_start_is_doing_and_for_how_long():
    starting = RunStatus(run_id="r", state="running", phase="loading the model", launched_at=time.time() - 65.2)
    assert "starting (1 min 05 s): loading the model…" in train_view.run_markdown(starting)
    # a resumed attempt shows its checkpoint's progress and what its start is doing
    resumed = dataclasses.replace(starting, phase="restoring a checkpoint", step=8, total_steps=20, progress=0.4)
    text = train_view.run_markdown(resumed)
    assert "step 8 / 20" in text and "restoring a checkpoint…" in text and "ETA" not in text
    # once it trains (no phase) or has ended, no "starting", no countdown, no "Stopping"
    training = dataclasses.replace(resumed, phase=None, eta_seconds=30.0)
    assert "starting" not in train_view.run_markdown(training)
    for state in ("stopped", "failed", "finished"):
        ended = train_view.run_markdown(dataclasses.replace(training, state=state, phase="loading data"))
        assert "starting" not in ended and "ETA" not in ended and "stopping" not in ended.lower()


def test_model_choices_list_finished_runs(tab):
    # the presets, then the demo model (what the chat serves offline, so chat feedback can retrain it)
    assert [v for _, v in train_handlers.base_model_choices(tab)] == ["tiny", DEFAULT_MODEL, str(DEMO_DIR)]
    final = tab.manager.root / "20250101-000000-abcdef" / "final"
    final.mkdir(parents=True)
    (final.parent / "run.json").write_text("{}")
    (final / "config.json").write_text("{}")
    assert str(final) not in [v for _, v in train_handlers.base_model_choices(tab)]  # no weights yet: not finished
    (final / "model.safetensors").write_bytes(b"")
    assert [v for _, v in train_handlers.base_model_choices(tab)][-2] == str(final)
    # a finished run is a valid base model on the CPU
    made = train_handlers.spec_from_form(tab, form(tab, model_name_or_path=str(final)), None)
    assert made.config.model_name_or_path == str(final)


# --------------------------------------------------------------------------- uploads


def refusal(tab, token, file, prefix="", uploads=None, which="train") -> str:
    """A refused upload: its box is cleared (None), nothing kept, and the reason shown where the preview goes."""
    kept, message, box = train_handlers.accept_upload(tab, token, None, uploads, which, file, prefix)
    assert box is None and getattr(kept, which) is None and which not in kept.names
    assert message.startswith("⚠️ **Cannot upload data:** "), message
    return message.removeprefix("⚠️ **Cannot upload data:** ")


def test_upload_needs_a_login_and_is_validated_then_copied(tab):
    upload = write_rows(tab.incoming / "my data.jsonl", 12)
    assert re.search("log in first", refusal(tab, None, str(upload), "chatbot: "))
    assert not tab.data_root.exists()  # nothing copied for an anonymous caller

    uploads, preview, box = train_handlers.accept_upload(
        tab, logged_in(tab), None, None, "train", str(upload), "chatbot: "
    )
    assert box == gr.skip()  # an accepted file stays in its box
    copy = Path(uploads.train)
    assert copy.is_relative_to(tab.data_root.resolve()) and copy.name == "train.jsonl"
    assert copy.read_bytes() == upload.read_bytes() and uploads.names == {"train": "my data.jsonl"}
    assert "**my data.jsonl**: 12 rows" in preview
    assert "```text\nchatbot: context: happy  <s> hello number 0\n```" in preview
    # the upload is now the run's data: the last 10% becomes the validation split
    spec = train_handlers.spec_from_form(tab, form(tab, data_source="upload"), uploads)
    assert spec.split_train_file == str(copy) and spec.holds_out_validation and spec.config.train_file is None

    val = write_rows(tab.incoming / "val.csv", 0)
    val.write_text("texts,labels\ncontext: sad  <s> hi,hello\n")
    uploads, *_ = train_handlers.accept_upload(tab, logged_in(tab), None, uploads, "validation", str(val), "")
    spec = train_handlers.spec_from_form(tab, form(tab, data_source="upload"), uploads)
    assert spec.config.validation_file == uploads.validation and uploads.validation.endswith("validation.csv")
    assert spec.config.train_file == uploads.train and not spec.holds_out_validation
    cleared, preview, _ = train_handlers.accept_upload(tab, None, None, uploads, "validation", None, "")
    assert cleared.validation is None and cleared.train == uploads.train and preview == ""


def test_bad_uploads_are_refused_with_the_reason(tab, tmp_path, monkeypatch):
    session = logged_in(tab)
    bad = tab.incoming / "bad.jsonl"
    bad.write_text(json.dumps({"texts": "x", "labels": "y"}) + "\n" + json.dumps({"texts": "x", "labels": " "}) + "\n")
    assert re.search(r"bad\.jsonl: row 2: column 'labels' is empty", refusal(tab, session, str(bad), ""))
    text = tab.incoming / "notes.txt"
    text.write_text("hello")
    assert re.search("unsupported file type", refusal(tab, session, str(text), ""))
    outside = write_rows(tmp_path / "elsewhere.jsonl", 3)  # not in gradio's upload folder
    assert re.search("not uploaded through this app", refusal(tab, session, str(outside), ""))
    assert "not uploaded through this app" in refusal(tab, session, str(tab.incoming / ".." / "elsewhere.jsonl"))
    big = write_rows(tab.incoming / "big.jsonl", 200)
    monkeypatch.setattr(jobs_uploads, "MAX_UPLOAD_BYTES", 1000)
    assert re.search("the limit is", refusal(tab, session, str(big), ""))
    assert not tab.data_root.exists()
    with pytest.raises(ValueError, match="unknown upload"):
        train_handlers.accept_upload(tab, session, None, None, "test", str(big), "")


def test_upload_refusals_name_the_users_file_not_the_servers_path(tab):
    session = logged_in(tab)
    (tab.incoming / "3f9a1c").mkdir()  # gradio keeps an upload as <upload folder>/<sha256>/<its name>
    bad = tab.incoming / "3f9a1c" / "my data.jsonl"
    bad.write_text(json.dumps({"texts": "x", "labels": "y"}) + "\n" + json.dumps({"texts": "x", "labels": " "}) + "\n")
    assert refusal(tab, session, str(bad), "") == "my data.jsonl: row 2: column 'labels' is empty"
    # a FileData (gradio's payload) names the file as the browser sent it
    payload = FileData(path=str(bad), orig_name="C:\\Users\\me\\Mes données.jsonl")
    assert refusal(tab, session, payload, "") == "Mes données.jsonl: row 2: column 'labels' is empty"
    good = write_rows(tab.incoming / "3f9a1c" / "tmp8x.jsonl", 3)
    uploads, preview, _ = train_handlers.accept_upload(
        tab, session, None, None, "train", FileData(path=str(good), orig_name="chats.jsonl"), ""
    )
    assert uploads.names == {"train": "chats.jsonl"} and "**chats.jsonl**: 3 rows" in preview


def test_a_parquet_bomb_upload_is_refused_and_nothing_is_copied(tab):
    upload = parquet_bomb(tab.incoming / "tiny.parquet")
    assert upload.stat().st_size < 1000
    assert refusal(tab, logged_in(tab), str(upload), "") == (
        "tiny.parquet: row 268436: the rows so far hold over 512 MB of text (the limit for an upload)"
    )
    assert not tab.data_root.exists()


def test_an_upload_is_refused_when_the_data_root_is_full(tab, monkeypatch):
    upload = write_rows(tab.incoming / "data.jsonl", 12)
    earlier = tab.data_root / "20240101-000000-aaaaaa"  # an upload no run uses, from 10 minutes ago
    earlier.mkdir(parents=True)
    (earlier / "train.jsonl").write_bytes(b"x" * 1000)
    monkeypatch.setattr(jobs_uploads, "MAX_DATA_ROOT_BYTES", 1000 + upload.stat().st_size - 1)
    for path in (earlier / "train.jsonl", earlier):
        os.utime(path, (time.time() - 600, time.time() - 600))
    assert re.search("storage for uploads is full", refusal(tab, logged_in(tab), str(upload), ""))
    assert [p.name for p in tab.data_root.iterdir()] == [earlier.name]  # nothing copied
    for path in (earlier / "train.jsonl", earlier):  # two hours old: removed to make room
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    uploads, *_ = train_handlers.accept_upload(tab, logged_in(tab), None, None, "train", str(upload), "")
    assert not earlier.exists() and Path(uploads.train).read_bytes() == upload.read_bytes()


def test_an_upload_copied_into_a_read_only_data_root_names_the_folder_and_the_cause(tab):
    """Issue 28: a failed write names the file and the cause, and leaves nothing half-copied."""
    upload = write_rows(tab.incoming / "data.jsonl", 12)
    with read_only(tab.data_root) as name:
        message = refusal(tab, logged_in(tab), str(upload), "")
    assert re.fullmatch(rf"cannot write {re.escape(str(tab.data_root))}/\S+: .*\({name}\)", message), message
    assert list(tab.data_root.iterdir()) == []


def test_a_run_in_a_read_only_runs_folder_names_it_and_the_cause(tab):
    with read_only(tab.manager.root) as name:
        with pytest.raises(gr.Error, match=rf"cannot write {re.escape(str(tab.manager.root))}/\S+: .*\({name}\)"):
            train_handlers.start_run(tab, logged_in(tab), None, None, form(tab))
    assert tab.manager.runs() == []


def put(folder: Path, name: str, size: int, age_s: float) -> Path:
    """A file as gradio stores an upload (<sha256>/<name>), last modified ``age_s`` ago."""
    path = folder / f"{abs(hash(name)):x}" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    then = time.time() - age_s
    os.utime(path, (then, then))
    os.utime(path.parent, (then, then))
    return path


def test_gradio_upload_folder_cleaner_removes_old_files_then_the_oldest_over_the_cap(tmp_path):
    folder = tmp_path / "gradio"
    old = put(folder, "old.jsonl", 10, age_s=40 * 60)  # over MAX_AGE_S (30 min)
    target = tmp_path / "outside.txt"
    target.write_text("keep me")
    link = folder / "link.txt"
    link.symlink_to(target)
    os.utime(link, (time.time() - 7200, time.time() - 7200), follow_symlinks=False)
    # the attack: ten 5 MB files within a second, all young
    flood = [put(folder, f"flood{i}.bin", 5 * 2**20, age_s=10 - i * 0.1) for i in range(10)]
    empty_old, empty_new = folder / "emptyold", folder / "emptynew"
    empty_old.mkdir()
    empty_new.mkdir()
    os.utime(empty_old, (time.time() - 600, time.time() - 600))

    cleaned = webui_uploads.clean_gradio_uploads(folder, max_bytes=20 * 2**20)
    left = sorted(p.name for p in folder.rglob("*") if p.is_file())
    assert left == ["flood6.bin", "flood7.bin", "flood8.bin", "flood9.bin"]  # the newest, within 20 MB
    assert (cleaned.removed, cleaned.left) == (1 + 1 + 6, 20 * 2**20) and not old.exists()
    assert not link.exists() and target.read_text() == "keep me"  # the link went, not what it points to
    assert not empty_old.exists() and not old.parent.exists() and empty_new.is_dir()
    assert all(p.exists() for p in flood[6:])
    assert webui_uploads.clean_gradio_uploads(folder, max_bytes=20 * 2**20).removed == 0
    assert webui_uploads.clean_gradio_uploads(tmp_path / "missing").removed == 0


def test_the_cleaner_thread_cleans_both_folders_until_stopped(tab):
    stale = put(tab.incoming, "stale.jsonl", 10, age_s=3600)
    unused = tab.data_root / "20240101-000000-bbbbbb"
    unused.mkdir(parents=True)
    (unused / "train.jsonl").write_text("x")
    for path in (unused / "train.jsonl", unused):
        os.utime(path, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    stop = threading.Event()
    thread = webui_uploads.start_cleaner(tab.incoming, tab.data_root, every_s=0.05, stop=stop)
    deadline = time.monotonic() + 10
    while (stale.exists() or unused.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    thread.join(5)
    assert not stale.exists() and not unused.exists() and not thread.is_alive()


# --------------------------------------------------------------------------- actions


@pytest.mark.parametrize(
    "config, token, message",
    [
        (AuthConfig(), "valid-elsewhere", "no login is configured"),  # a token cannot help: there is no login
        (AuthConfig(password=PASSWORD), None, "log in first"),
        (AuthConfig(password=PASSWORD), "forged-token", "log in first"),
    ],
)
def test_actions_are_refused_without_a_login(tab, config, token, message):
    tab.auth = config
    if token == "valid-elsewhere":
        token = AuthConfig(password=PASSWORD).logins.issue()  # live on another server's login list
    actions = [
        lambda: train_handlers.start_run(tab, token, None, None, form(tab)),
        lambda: train_handlers.stop_run(tab, token, None),
        lambda: train_handlers.resume_run(tab, token, None),
        lambda: train_handlers.push_run(tab, token, None, "me/chat", False),
    ]
    for action in actions:
        with pytest.raises(gr.Error, match=message):
            action()
    assert tab.manager.runs() == []


def test_actions_explain_what_is_not_possible(tab):
    session = logged_in(tab)
    with pytest.raises(gr.Error, match="no run is running"):
        train_handlers.stop_run(tab, session, None)
    with pytest.raises(gr.Error, match="no run to resume"):
        train_handlers.resume_run(tab, session, None)
    with pytest.raises(gr.Error, match="only a finished run can be pushed"):
        train_handlers.push_run(tab, session, None, "me/chat", False)
    with pytest.raises(gr.Error, match="needs a GPU"):
        train_handlers.start_run(tab, session, None, None, form(tab, model_name_or_path=DEFAULT_MODEL))
    assert tab.manager.runs() == []


# --------------------------------------------------------------------------- live view


def fake_finished_run(tab, run_id="20250101-000000-abcdef") -> Path:
    """A finished run's directory as the CLI leaves it (metrics written by the CLI's own writer)."""
    run_dir = tab.manager.root / run_id
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "config.json").write_text("{}")
    (run_dir / "final" / "model.safetensors").write_bytes(b"")  # a complete final model: config and weights
    spec = JobSpec(app_config("tiny", dataset_name="sample"))
    (run_dir / "run.json").write_text(
        json.dumps(
            {"run_id": run_id, "spec": spec.to_dict(), "argv": ["python", "-m", "finetune"], "metrics_offset": 0}
        )
    )
    (run_dir / "train.log").write_text("line 1\nfinal model in final\n")
    metrics = ckpt.MetricsWriter(run_dir, enabled=True)
    metrics.write("start", total_steps=4, resumed_at=0)
    for step, loss in ((1, 7.5), (2, 7.0), (4, 6.5)):
        metrics.write("log", step=step, loss=loss, samples_per_second=120.0)
    metrics.write(
        "eval",
        step=4,
        eval_bleu=3.25,
        eval_loss=6.4,
        samples=[{"prompt": "chatbot: hi", "prediction": "hello", "reference": "hey"}] * 7,
    )
    metrics.write("done", step=4, eval_bleu=3.25)
    return run_dir


def test_live_view_sends_only_changes(tab):
    calls = []
    makers = (lambda: calls.append("train") or "train-models", lambda: calls.append("chat") or "chat-models")
    cache, run, loss, bleu, pref, samples, log_tail, action, train_models, chat_models = train_view.live_view(
        tab, None, makers, visitor=False
    )
    assert pref["visible"] is False and pref["y_lim"] == [0, 100]  # shown only for runs that report it
    loss = loss["value"]  # a plot's update: its points and axes
    assert run.startswith("💤 No run yet") and list(loss.columns) == ["step", "loss"] and loss.empty
    assert log_tail == "" and (train_models, chat_models) == ("train-models", "chat-models")
    assert action == gr.skip()  # the action line is left alone

    cache, *again = train_view.live_view(tab, cache, makers)  # the plots' points again, to their new drawing
    assert [type(value) for value in again[1:3]] == [pd.DataFrame] * 2 and again[1].empty
    cache, *again = train_view.live_view(tab, cache, makers)
    assert all(value == gr.skip() for value in again) and calls == ["train", "chat"]

    run_dir = fake_finished_run(tab)
    cache, run, loss, bleu, pref, samples, log_tail, action, train_models, chat_models = train_view.live_view(
        tab, cache, makers
    )
    # both plots span the whole run (4 steps, and a little room for the last evaluation's point)
    assert loss["x_lim"] == bleu["x_lim"] == [0, 5] and loss["y_lim"] == [None, None]  # (None: fitted)
    assert bleu["y_lim"] == [0, 3.74]  # from 0 to a little above its best, 3.25: that point drawn whole
    loss, bleu = loss["value"], bleu["value"]
    assert action == ""  # the run ended since the last redraw: "Started run ..." / "Stopping run ..." goes
    assert "**Run 20250101-000000-abcdef**: finished" in run and "step 4 / 4 (100%)" in run and "BLEU 3.25" in run
    assert f"`runs/{run_dir.name}/final`" in run and str(tab.manager.root) not in run and "Model** list" in run
    pd.testing.assert_frame_equal(loss, pd.DataFrame({"step": [1, 2, 4], "loss": [7.5, 7.0, 6.5]}))
    assert bleu.to_dict("records") == [{"step": 4, "bleu": 3.25}]
    assert len(samples) == train_view.SAMPLES_SHOWN and samples.iloc[0].to_dict() == {
        "prompt": "chatbot: hi",
        "prediction": "hello",
        "reference": "hey",
    }
    assert log_tail.endswith("final model in final") and calls == ["train", "chat"] * 2
    # gradio draws a plot anew when its limits change, and can drop points sent with them: sent again once
    cache, *again = train_view.live_view(tab, cache, makers)
    pd.testing.assert_frame_equal(again[1], loss)
    pd.testing.assert_frame_equal(again[2], bleu)
    assert again[3]["visible"] is False and again[3]["value"].empty  # an SFT run: no preference points
    assert all(value == gr.skip() for i, value in enumerate(again) if i not in (1, 2, 3))
    cache, *again = train_view.live_view(tab, cache, makers)
    assert all(value == gr.skip() for value in again)


def test_visitors_do_not_see_rows_of_uploaded_data_nor_server_paths(tab):
    run_dir = fake_finished_run(tab)
    info = json.loads((run_dir / "run.json").read_text())
    upload = tab.data_root / "20250101-000000-abcdef" / "train.jsonl"
    write_rows(upload.parent.mkdir(parents=True) or upload, 30)
    info["spec"] = JobSpec(app_config("tiny", dataset_name="sample"), split_train_file=str(upload)).to_dict()
    (run_dir / "run.json").write_text(json.dumps(info))
    with open(run_dir / "train.log", "a") as log:
        log.write(
            f"12:00:00 INFO finetune: prompt: 'secret' | prediction: 'x' | reference: 'y'\n"
            f"12:00:01 INFO finetune: final model in {run_dir / 'final'}\n"
        )
    _, run, _, _, _, samples, log_tail, _ = train_view.live_view(tab, None, visitor=True)
    assert samples.empty and "secret" not in log_tail
    assert str(tab.manager.root) not in run + log_tail and f"runs/{run_dir.name}/final" in log_tail
    _, run, _, _, _, samples, log_tail, _ = train_view.live_view(tab, None, visitor=False)  # the trainer sees them
    assert len(samples) == train_view.SAMPLES_SHOWN and "secret" in log_tail
    assert str(tab.manager.root) not in run + log_tail


def test_run_markdown_states():
    running = RunStatus(
        run_id="r",
        state="running",
        step=5,
        total_steps=20,
        progress=0.25,
        eta_seconds=75,
        samples_per_second=12.34,
        gpu_mem_gib=3.21,
    )
    text = train_view.run_markdown(running)
    assert "running" in text and "step 5 / 20 (25%)" in text and "ETA 1 min 15 s" in text
    assert "12.3 samples/s" in text and "GPU memory 3.2 GiB" in text
    assert "starting: launching…" in train_view.run_markdown(RunStatus(run_id="r", state="running"))
    failed = train_view.run_markdown(
        RunStatus(run_id="r", state="failed", error="CUDA out of memory", has_checkpoint=True)
    )
    assert "**Error:** CUDA out of memory" in failed and "**Resume**" in failed
    pushed = train_view.run_markdown(RunStatus(run_id="r", state="finished", pushed_url="https://hf.co/me/chat"))
    assert "Pushed to https://hf.co/me/chat" in pushed


def test_pushed_event_shows_and_clears_an_earlier_push_error(tab):
    run_dir = fake_finished_run(tab)
    metrics = ckpt.MetricsWriter(run_dir, enabled=True)
    metrics.write("error", message="could not push (offline)")
    assert tab.manager.status().error == "could not push (offline)"
    metrics.write("pushed", repo="me/chat", url="https://huggingface.co/me/chat")
    status = tab.manager.status()
    assert status.state == "finished" and status.error is None and status.pushed_url == "https://huggingface.co/me/chat"


@pytest.mark.parametrize(
    "seconds, text",
    [(None, "?"), (0, "0 s"), (59.4, "59 s"), (61, "1 min 01 s"), (3725, "1 h 02 min"), (float("inf"), "?")],
)
def test_format_duration(seconds, text):
    assert train_view.format_duration(seconds) == text


def test_hardware_note():
    assert "needs a GPU" in train_handlers.hardware_note(0) and "tiny" in train_handlers.hardware_note(0)
    assert "2 GPUs" in train_handlers.hardware_note(2)
    assert train_view.progress_bar(0.5, 10) == "█████░░░░░"


def test_data_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSONA_CHAT_DATA", str(tmp_path / "d"))
    assert paths.data_root() == (tmp_path / "d").resolve() and paths.data_root() in paths.allowed_roots()
    monkeypatch.delenv("PERSONA_CHAT_DATA")
    assert paths.data_root() == Path(os.getcwd(), paths.DATA_ROOT).resolve()


# --------------------------------------------------------------------------- issue 11's Train-tab leftovers


def test_controls_are_locked_until_a_login(tab):
    assert train_handlers.controls_state(tab, None, None) == (
        False,
        "🔒 The form and Start, Stop, Resume and Push unlock when you log in (above).",
    )
    assert train_handlers.controls_state(tab, "forged", None)[0] is False
    token = logged_in(tab)
    assert train_handlers.controls_state(tab, token, None) == (True, "")
    tab.auth.logins.revoke(token)  # logged out
    assert train_handlers.controls_state(tab, token, None)[0] is False
    tab.auth = AuthConfig()  # nothing configured: locked for everyone, saying why
    allowed, why = train_handlers.controls_state(tab, None, None)
    assert not allowed and "off" in why and "Show command" in why


def test_the_log_box_gets_the_newest_lines_newest_last(tab):
    run_dir = fake_finished_run(tab)
    (run_dir / "train.log").write_text("".join(f"line {i}\n" for i in range(100)))
    log_tail = train_view.live_view(tab, None, visitor=False)[6]
    assert log_tail.splitlines() == [f"line {i}" for i in range(100 - train_view.LOG_LINES, 100)]


def test_the_tab_layout_shows_what_is_possible_and_stays_short(tab):
    from webui import train_tab

    with gr.Blocks() as demo:
        train_tab.build(tab, gr.BrowserState(None))
    by_id = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    # a single BLEU point is drawn (a LinePlot draws no line of one point, and has no point marks)
    assert isinstance(by_id["train-bleu"], gr.ScatterPlot) and isinstance(by_id["train-loss"], gr.LinePlot)
    # before a login (the page-state event unlocks them) the actions and the form are locked
    for elem_id in ("train-start", "train-stop", "train-resume", "train-push", "train-model", "train-batch"):
        assert by_id[elem_id].interactive is False, elem_id
    assert by_id["train-show-command"].interactive is not False  # open to everyone
    assert by_id["train-log"].max_lines == train_view.LOG_LINES and by_id["train-log"].autoscroll
    # secondary panels start collapsed (the tab on a phone: 5,070 px before, ~3,400 px after)
    for elem_id in ("review", "train-more", "train-samples-panel", "train-push-panel"):
        assert by_id[elem_id].open is False, elem_id


def test_run_markdown_shows_bleu_by_kind_and_on_held_out_feedback():
    status = RunStatus(run_id="r", state="finished", eval_bleu=20.0, bleu_parts={"persona": 30.46, "feedback": 8.25})
    text = train_view.run_markdown(status)
    assert "BLEU 20.00" in text and "BLEU by kind: persona 30.5 · held-out chat feedback 8.2" in text
    assert "by kind" not in train_view.run_markdown(dataclasses.replace(status, bleu_parts={}))


# --------------------------------------------------------------------------- the train batch and the pre-flight line

H200 = ("NVIDIA H200", 139.8)  # (name, GiB) as torch reports the card


def gpu_tab(tab, gpu=H200) -> train_handlers.TrainTab:
    """The tab on a machine with one GPU (nothing here launches: only refusals and lines)."""
    return dataclasses.replace(tab, gpus=1, gpu=gpu)


def preflight(tab, **changes) -> str:
    values = form(tab, **changes)
    return train_handlers.preflight_markdown(tab, {name: values[name] for name in train_preflight.FIELDS})


@pytest.mark.parametrize("value, expect", [("auto", "auto"), (" Auto ", "auto"), ("16", 16), (16, 16), (16.0, 16)])
def test_the_train_batch_box_takes_a_positive_number_or_auto(tab, value, expect):
    spec = train_handlers.spec_from_form(tab, form(tab, per_device_train_batch_size=value), None)
    assert spec.config.per_device_train_batch_size == expect
    shown = train_handlers.show_command(tab, None, form(tab, per_device_train_batch_size=value))
    assert f"--per_device_train_batch_size {expect} " in shown  # what Start runs


@pytest.mark.parametrize(
    "value, shown", [("0", "'0'"), ("-4", "'-4'"), ("lots", "'lots'"), ("", "nothing"), (2.5, "2.5")]
)
def test_the_train_batch_box_refuses_anything_else_naming_itself(tab, value, shown):
    message = f"Train batch (per device) must be a positive whole number or 'auto', got {shown}"
    with pytest.raises(ValueError, match=re.escape(message)):
        train_handlers.spec_from_form(tab, form(tab, per_device_train_batch_size=value), None)
    assert preflight(tab, per_device_train_batch_size=value) == f"⚠️ **Pre-flight:** {message}"


def test_preflight_on_the_cpu_says_auto_is_the_cpu_default_and_no_estimate_applies(tab):
    line = preflight(tab)
    assert line == (
        "🧮 **Pre-flight:** CPU run: `auto` means the CPU default, 8 rows per process, and no GPU memory "
        "estimate applies."
    )
    assert preflight(tab, per_device_train_batch_size="16").endswith("; this run: 16 rows per process.")
    # what Start would refuse anyway says why here too
    assert "'ddp' needs GPUs" in preflight(tab, strategy="ddp")
    assert "1 GPU(s) asked for, 0 visible" in preflight(tab, num_gpus=1)
    # a GPU machine's run on its CPU (0 GPUs chosen): the same
    assert preflight(gpu_tab(tab), num_gpus=0, model_name_or_path="tiny").startswith("🧮 **Pre-flight:** CPU run")


def test_preflight_on_a_gpu_estimates_memory_and_time_per_epoch(tab, monkeypatch):
    monkeypatch.setenv("PERSONA_CHAT_CACHE", str(tab.data_root.parent / "no-presets"))  # the 400M recipe, not built
    gpu = gpu_tab(tab)
    shape = memory.ModelShape.local("random-400M")
    setup = memory.Setup("zero2", "bf16", 1, 128, 64)
    run = {"model_name_or_path": "random-400M", "num_gpus": 1, "precision": "bf16", "n_train": 10_000}
    picked = memory.pick_batch(shape, setup, H200[1])
    est = memory.estimate(shape, picked, setup, H200[1], gpu_name=H200[0], train_rows=1423)  # the whole sample
    line = preflight(gpu, **run)
    assert line == (
        f"🧮 **Pre-flight:** `auto` picks {picked:,} rows per GPU: {memory.preflight_line(est)} (NVIDIA H200, bf16)."
    )
    assert "GiB peak per GPU of 140; ≈ " in line and " s per epoch" in line
    fits = preflight(gpu, **run, per_device_train_batch_size="800")
    est = memory.estimate(shape, 800, setup, H200[1], gpu_name=H200[0], train_rows=1423)
    assert fits.startswith("🧮 **Pre-flight:** batch 800 per GPU: ") and memory.preflight_line(est) in fits
    # the line follows the lengths and the strategy (cheap: no model is loaded)
    shorter = preflight(gpu, **run, per_device_train_batch_size="800", max_source_length=32, max_target_length=16)
    ddp = preflight(gpu, **run, per_device_train_batch_size="800", strategy="ddp")
    assert len({fits, shorter, ddp}) == 3
    # a model whose config is not on this machine: no estimate, nothing downloaded
    unknown = preflight(gpu, **{**run, "model_name_or_path": "someone/not-here"})
    assert "memory estimate unavailable" in unknown and "nothing is downloaded" in unknown


def test_a_batch_that_will_not_fit_is_refused_before_start_naming_the_one_that_does(tab, monkeypatch):
    monkeypatch.setenv("PERSONA_CHAT_CACHE", str(tab.data_root.parent / "no-presets"))
    gpu = gpu_tab(tab)
    run = {
        "model_name_or_path": "random-400M",
        "num_gpus": 1,
        "precision": "bf16",
        "per_device_train_batch_size": "4000",
    }
    fits = memory.pick_batch(memory.ModelShape.local("random-400M"), memory.Setup(), H200[1])
    line = preflight(gpu, **run)
    assert line.startswith("⛔ **Pre-flight:** --per_device_train_batch_size 4000 needs ≈ ")
    assert f"{fits} fits" in line and "Start is refused until it fits" in line
    with pytest.raises(gr.Error, match=f"{fits} fits") as refused:
        train_handlers.start_run(gpu, logged_in(gpu), None, None, form(gpu, **run))
    assert refused.value.title == "Cannot start a run" and tab.manager.runs() == []  # nothing launched
    # without knowing the GPU's memory the tab cannot judge: no refusal, and the line says so
    assert "GPU's memory is not known" in preflight(gpu_tab(tab, gpu=None), **run)
    spec = train_handlers.spec_from_form(gpu, form(gpu, **run), None)
    train_preflight.check_start(spec, None)  # (no refusal)


def test_the_action_line_is_cleared_when_the_run_ends(tab, monkeypatch):
    statuses = iter(
        [
            RunStatus(run_id="r", state="running"),
            RunStatus(run_id="r", state="stopping"),
            RunStatus(run_id="r", state="stopping"),
            RunStatus(run_id="r", state="stopped"),
            RunStatus(run_id="r", state="stopped"),
            RunStatus(run_id="r", state="running"),
        ]
    )
    monkeypatch.setattr(tab.manager, "status", lambda *a: next(statuses))
    cache, actions = None, []
    for _ in range(6):
        cache, *out = train_view.live_view(tab, cache)
        actions.append(out[6])
    # "Stopping run r: ..." stays while it stops, and goes once it has stopped; a resume's message stays
    assert actions == [gr.skip(), gr.skip(), gr.skip(), "", gr.skip(), gr.skip()]
    monkeypatch.setattr(tab.manager, "status", lambda *a: RunStatus(run_id="r", state="finished"))
    assert train_view.live_view(tab, None)[7] == gr.skip()  # a page opening on an ended run: nothing to clear


def test_the_plots_axes_fit_the_run_and_never_show_a_lone_value(tab):
    status = RunStatus(total_steps=120, loss_points=[{"step": 1, "loss": 7.59758}], bleu_points=[])
    fitted = [None, None]  # an update's None would keep the range it replaces
    assert train_view.steps_axis(status) == [0, 123] and train_view.steps_axis(RunStatus()) == fitted
    assert train_view.values_axis(train_view.loss_frame(status), "loss") == [0, 8.74]  # one point: from 0
    two = dataclasses.replace(status, loss_points=[{"step": 1, "loss": 7.5}, {"step": 2, "loss": 7.1}])
    assert train_view.values_axis(train_view.loss_frame(two), "loss") == fitted  # a curve: fitted to it
    assert train_view.values_axis(train_view.bleu_frame(two), "bleu") == [0, 1]  # BLEU: from 0, none yet
    scored = dataclasses.replace(two, bleu_points=[{"step": 60, "bleu": 1.004}, {"step": 120, "bleu": 0.75}])
    assert train_view.values_axis(train_view.bleu_frame(scored), "bleu") == [0, 1.15]


def test_refusals_name_the_settings_as_the_form_labels_them(tab):
    """A blank learning rate said "learning_rate is required" (the CLI's flag, not the form's label)."""
    tab.form_labels = {"learning_rate": "Learning rate", "num_train_epochs": "Epochs", "n_train": "Train rows"}
    try:
        for changes, said in (
            ({"learning_rate": None}, "Learning rate is required"),
            ({"learning_rate": 0}, "Learning rate must be > 0"),
            ({"num_train_epochs": -1}, "Epochs must be >= 1, got -1"),
            ({"learning_rate": 2.0}, "Learning rate must be at most 1 for runs of the app, got 2"),
        ):
            with pytest.raises(ValueError) as refused:
                train_handlers.spec_from_form(tab, form(tab, **changes), None)
            assert str(refused.value) == said
            assert train_handlers.show_command(tab, None, form(tab, **changes)) == f"# no command: {said}"
        words = train_words.in_form_words("n_train_extra and n_train", tab.form_labels)
        assert words == "n_train_extra and Train rows"  # whole names only
    finally:
        tab.form_labels = {}


def test_the_feedback_share_line_says_what_the_mix_makes_of_the_rows(tab):
    """Three accepted rows at the default share became ~1,400 of ~2,800 training rows with no hint:
    the line under the share says so, as finetune.data.mix really draws them (checked against it)."""
    from finetune.data import load_raw, mix

    store = tab.feedback_store()
    assert "No accepted chat feedback yet" in train_preflight.feedback_line(store, "sample", 0, 0.5)
    for i, rating in enumerate(("correction", "like", "correction", "dislike")):  # a dislike is not trained on
        store.add(
            kind="none",
            context="",
            turns=[f"hello {i}"],
            response=f"hi there number {i}!",
            rating=rating,
            visitor="trainer:password",
            status="accepted",
        )
    line = train_preflight.feedback_line(store, "sample", 0, 0.5)
    base = load_raw(TrainConfig(dataset_name="sample"))["train"]
    feedback = base.select(range(3))  # three rows, as the export makes of the three trained ones
    mixed = len(mix(base, feedback, 0.5, seed=42))
    found = re.search(r"each epoch ≈ ([\d,]+) rows, ([\d,]+) of them feedback: each accepted row ≈ ([\d,]+)×", line)
    epoch, drawn, times = (int(n.replace(",", "")) for n in found.groups())
    assert "3 accepted rows at a share of 0.5" in line and abs(epoch - mixed) / mixed < 0.02, (line, mixed)
    assert drawn == round(epoch / 2) and times == round(drawn / 3) > 400
    assert "A share near 0.0021" in line  # the rows' own share, where each is seen about once
    assert "3 accepted rows, trained on alone" in train_preflight.feedback_line(store, "sample", 0, 1)
    assert "depends on the dataset's size" in train_preflight.feedback_line(store, "hub", 0, 0.5)
    assert "each epoch ≈ 200 rows" in train_preflight.feedback_line(store, "sample", 100, 0.5)  # n_train rows
