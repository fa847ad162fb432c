"""The runs view's logic without a browser (webui/runs_handlers.py): the table, filters and sorting,
overlaid curves and the settings that differ, and per-run actions behind the login."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from chat.engine import DEMO_DIR, ChatEngine, load_apart
from chat.layout import FINAL
from finetune.checkpoint import MetricsWriter
from finetune.jobs.manager import RunManager
from webui import chat_handlers
from webui import runs_handlers as runs
from webui.auth import AuthConfig, AuthError

PASSWORD = "runs-view-password"


def cli_run(root: Path, name: str, base: str, bleu=(10.0, 12.5), done=True, stopped=False, **settings) -> Path:
    """A run folder as ``python -m finetune --output_dir ROOT/NAME`` leaves it, the demo model's
    weights as its final model (so it can be served)."""
    folder = root / name
    metrics = MetricsWriter(folder, enabled=True)
    metrics.write("start", total_steps=20, train_samples=1423, eval_samples=187, resumed_at=0)
    for step, value in zip((10, 20), bleu):
        metrics.write("log", step=step, loss=3.0 - step / 10)
        metrics.write(
            "eval", step=step, eval_bleu=value, eval_loss=2.5, eval_bleu_persona=value + 1, eval_context_hits=0.6
        )
    if stopped:
        metrics.write("stopped", step=10)
    if done:
        shutil.copytree(DEMO_DIR, folder / FINAL)
        args = {"model_name_or_path": base, "dataset_name": "sample", "learning_rate": 1e-3, "output_dir": str(folder)}
        (folder / FINAL / "training_args.json").write_text(json.dumps({**args, **settings}))
        metrics.write("done", step=20, final=str(folder / FINAL), eval_bleu=bleu[-1])
    return folder


@pytest.fixture(scope="module")
def engine():
    return ChatEngine(load_apart(str(DEMO_DIR), optimize="none"), f"serving {DEMO_DIR}")


@pytest.fixture
def view(tmp_path, engine, monkeypatch):
    root = tmp_path / "runs"
    monkeypatch.setenv("PERSONA_CHAT_RUNS", str(root))
    first = cli_run(root, "20261203-100000-aaaaaa", "tiny")
    cli_run(root, "20261203-110000-bbbbbb", str(first / FINAL), bleu=(13.0, 15.0), learning_rate=3e-4)
    cli_run(root, "20261203-090000-cccccc", "tiny", bleu=(4.0,), done=False, stopped=True)
    (root / "20261203-080000-dddddd").mkdir()
    (root / "20261203-080000-dddddd" / "run.json").write_text("{")
    (root / "photos").mkdir()
    services = runs.RunsServices(engine, AuthConfig(password=PASSWORD), RunManager(root))
    token = services.auth.logins.issue()
    yield services, token
    engine.swap(str(DEMO_DIR))


def ids(frame, column="run"):
    return list(frame[column])


def test_the_table_lists_every_folder_with_state_lineage_and_scores(view):
    services, _ = view
    found = runs.records(services)
    frame = runs.table(found, runs.filtered(found))
    assert ids(frame) == [
        "20261203-110000-bbbbbb",
        "20261203-100000-aaaaaa",
        "20261203-090000-cccccc",
        "20261203-080000-dddddd",
        "photos",
    ]
    by_run = frame.set_index("run")
    assert by_run.loc["20261203-110000-bbbbbb", "continued from"] == "20261203-100000-aaaaaa"
    assert by_run.loc["20261203-110000-bbbbbb", "base model"] == "run 20261203-100000-aaaaaa"  # no server path
    assert by_run.loc["20261203-090000-cccccc", "state"] == "stopped"
    assert by_run.loc["20261203-080000-dddddd", "state"].startswith("corrupt: run.json unreadable")
    assert by_run.loc["photos", "state"].startswith("foreign")
    assert (by_run.loc["20261203-110000-bbbbbb", "BLEU"], by_run.loc["20261203-110000-bbbbbb", "best BLEU"]) == (
        "15.0",
        "15.0",
    )
    assert by_run.loc["20261203-100000-aaaaaa", "context"] == "0.60"
    assert "persona 13.5" in by_run.loc["20261203-100000-aaaaaa", "BLEU by kind"]
    assert "2 folder(s) are not readable runs" in runs.summary(found, found)
    # The Train tab's live view (the latest run the app launched) is not thrown by the corrupt run.json.
    assert services.manager.status().state == "idle"
    assert all(str(services.root) not in str(v) for v in frame.to_numpy().ravel())


def test_filter_state_and_sort(view):
    services, _ = view
    found = runs.records(services)
    assert ids(runs.table(found, runs.filtered(found, "stopped"))) == ["20261203-090000-cccccc"]
    assert ids(runs.table(found, runs.filtered(found, state="finished", sort="best BLEU"))) == [
        "20261203-110000-bbbbbb",
        "20261203-100000-aaaaaa",
    ]
    # a run, and the run continued from it (its base as shown)
    assert ids(runs.table(found, runs.filtered(found, "aaaaaa"))) == [
        "20261203-110000-bbbbbb",
        "20261203-100000-aaaaaa",
    ]
    assert ids(runs.table(found, runs.filtered(found, "runs"))) == []  # server paths are not searched


def test_two_runs_overlay_their_curves_and_show_only_what_differs(view):
    services, _ = view
    diff, frames, note = runs.compare_view(services, ["20261203-100000-aaaaaa", "20261203-110000-bbbbbb", "forged"])
    assert list(diff["setting"]) == ["learning_rate", "model_name_or_path"]
    assert list(diff.iloc[1, 1:]) == ["tiny", "run 20261203-100000-aaaaaa"]
    assert set(frames["bleu"]["run"]) == {"20261203-100000-aaaaaa", "20261203-110000-bbbbbb"}
    assert list(frames["bleu"]["value"]) == [10.0, 12.5, 13.0, 15.0] and len(frames["loss"]) == 4
    assert "2 runs overlaid; 2 settings differ" in note
    assert len(runs.compare_view(services, ["20261203-100000-aaaaaa"])[0]) == 0  # one run: nothing to compare


@pytest.mark.parametrize("act", ["serve", "command", "rename", "ask_delete", "to_compare"])
def test_actions_need_the_login(view, act):
    services, _ = view
    args = ["20261203-100000-aaaaaa"] + (["x"] if act == "rename" else [])
    with pytest.raises(AuthError):
        getattr(runs, act)(services, "forged-token", None, *args)


def test_serve_a_run_then_it_cannot_be_deleted_and_another_can(view):
    services, token = view
    note = runs.serve(services, token, None, "20261203-110000-bbbbbb")
    assert note.startswith("✅ Now serving")
    assert Path(services.engine.current.name) == services.root / "20261203-110000-bbbbbb" / FINAL
    with pytest.raises(ValueError, match="serving in the chat"):
        runs.ask_delete(services, token, None, "20261203-110000-bbbbbb")
    with pytest.raises(ValueError, match="no finished model"):
        runs.serve(services, token, None, "20261203-090000-cccccc")
    pending, question = runs.ask_delete(services, token, None, "20261203-090000-cccccc")
    assert "cannot be undone" in question
    with pytest.raises(ValueError, match="Press Delete again"):
        runs.delete(services, token, None, "20261203-100000-aaaaaa", pending)  # the menu moved on
    assert runs.delete(services, token, None, pending, pending).startswith("🗑️ Deleted")
    assert not (services.root / pending).exists()
    assert pending not in [r.run_id for r in runs.records(services)]
    assert sorted(p.name for p in services.root.iterdir() if p.name.startswith(".")) == []  # nothing half-deleted


def test_rename_is_kept_in_run_json_and_shown_by_the_table_and_the_picker(view):
    services, token = view
    runs.rename(services, token, None, "20261203-100000-aaaaaa", "  the   first one ")
    info = json.loads((services.root / "20261203-100000-aaaaaa" / "run.json").read_text())
    assert info == {"label": "the first one"}
    assert services.manager.status().state == "idle"  # a name alone is no run the app launched
    found = runs.records(services)
    by_id = {r.run_id: r for r in found}
    assert by_id["20261203-100000-aaaaaa"].state == "finished"  # a name alone keeps it a command-line run
    frame = runs.table(found, found).set_index("run")
    assert frame.loc["20261203-110000-bbbbbb", "continued from"] == "the first one"
    labels = [label for label, _ in chat_handlers.picker_choices(services.root)]
    assert any(label.startswith("the first one · ") and "context 0.60" in label for label in labels)
    assert not any("cccccc" in label for label in labels)  # the stopped run has no model to serve
    with pytest.raises(ValueError, match="at most 80"):
        runs.rename(services, token, None, "20261203-100000-aaaaaa", "x" * 81)
    with pytest.raises(ValueError, match="corrupt"):
        runs.rename(services, token, None, "20261203-080000-dddddd", "fixed")


def test_a_command_line_runs_command_is_its_settings_as_flags(view):
    services, token = view
    text = runs.command(services, token, None, "20261203-110000-bbbbbb")
    assert text.startswith("python -m finetune")
    assert "--learning_rate 0.0003" in text and "--output_dir" in text
    with pytest.raises(ValueError, match="Pick a run"):
        runs.command(services, token, None, "../../etc")  # only ids the index lists


def test_push_refuses_a_bad_repo_and_an_unfinished_run(view):
    services, token = view
    with pytest.raises(ValueError, match="user/name"):
        runs.push(services, token, None, "20261203-100000-aaaaaa", "not a repo", False)
    with pytest.raises(ValueError, match="no finished model"):
        runs.push(services, token, None, "20261203-090000-cccccc", "me/bot", False)


def test_send_to_compare_gives_the_runs_model_for_compares_b_menu(view):
    services, token = view
    spec, note = runs.to_compare(services, token, None, "20261203-100000-aaaaaa")
    assert spec == str(services.root / "20261203-100000-aaaaaa" / FINAL) and "model **B**" in note
    assert spec in [s for _, s in chat_handlers.picker_choices(services.root)]  # a choice Compare's menu offers
    with pytest.raises(ValueError, match="no finished model"):
        runs.to_compare(services, token, None, "20261203-090000-cccccc")
