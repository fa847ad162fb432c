"""The Train tab through the launched app (gradio_client, offline, 127.0.0.1, the demo model).

The train endpoints are private: gradio_client refuses to call them. That is not security (the
browser calls them by number, and so can anyone), so these tests lift the client's guard, as an
attacker would, and check that the *handlers* refuse: anonymous callers when a password is set,
everyone when no login is configured. A logged-in session uploads data, trains a tiny model for
real, and serves the new checkpoint in the chat.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from served_app import App, Caller, serve

from chat.engine import DEMO_DIR
from chat.layout import SAMPLE_DIR
from finetune.jobs.uploads import MAX_UPLOAD_BYTES
from webui import auth, chat_handlers, train_handlers, train_view

PASSWORD = "s3cret-for-tests"
TIMEOUT = 120


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    """The app with TRAIN_PASSWORD set."""
    yield from serve(tmp_path_factory, "locked", PASSWORD)


@pytest.fixture(scope="module")
def open_app(tmp_path_factory):
    """The app with no login configured."""
    served = App(tmp_path_factory.mktemp("open"), auth.AuthConfig())
    yield served
    served.close()


def run_form(tab, **changes) -> list:
    """The form's values in FORM_FIELDS order: how an API client sends them."""
    values = {
        **train_handlers.default_form(tab),
        "n_train": 96,
        "n_val": 8,
        "num_train_epochs": 1,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 8,
        "num_beams": 1,
        "logging_steps": 1,
        **changes,
    }
    assert set(values) == set(train_handlers.FORM_FIELDS)
    return [values[name] for name in train_handlers.FORM_FIELDS]


def guarded_calls(served: App, upload: Path) -> dict:
    """Every action that needs a login, with valid arguments."""
    return {
        "train_start": run_form(served.tab),
        "train_stop": [],
        "train_resume": [],
        "train_push": ["someone/chat", False, False],
        "review_accept": [],  # (the selected row is server-side state)
        "review_reject": [],
        "review_save": ["a better reply"],
        "review_accept_all": [],
        "review_export": [],
    }


def copied(served: App) -> list[Path]:
    """Uploads copied into the data root (its feedback/ folder is the chat's feedback store)."""
    return [p for p in served.data.glob("*") if p.name != "feedback"]


def refused_uploads(caller: Caller, upload: Path) -> list[str]:
    """A refused upload answers with the reason where its preview goes, and clears its box (None)."""
    out = []
    for which in ("train", "validation"):
        preview, box = caller(f"train_upload_{which}", handle_file(str(upload)), "chatbot: ")
        assert box is None
        out.append(preview)
    return out


@pytest.fixture(scope="module")
def upload_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("files") / "dialogues.jsonl"
    path.write_text((SAMPLE_DIR / "validation.jsonl").read_text())
    return path


# --------------------------------------------------------------------------- refusals


def test_train_endpoints_are_not_in_the_api(locked):
    client = Client(locked.url, verbose=False)
    assert list(client.view_api(return_format="dict", print_info=False)["named_endpoints"]) == ["/chat"]
    with pytest.raises(ValueError, match="Cannot find a function with `api_name`: /train_start"):
        client.predict(*run_form(locked.tab), api_name="/train_start")


def test_anonymous_callers_are_refused_server_side(locked, upload_file):
    caller = Caller(locked.url)
    serving = locked.engine.current
    for api_name, args in guarded_calls(locked, upload_file).items():
        with pytest.raises(AppError, match="log in first"):
            caller(api_name, *args)
    assert all("log in first" in text for text in refused_uploads(caller, upload_file))
    # Load answers in its own line under the button (not with error badges over the picker)
    assert "log in first" in caller("load_model", str(DEMO_DIR), "")
    assert locked.tab.manager.runs() == [] and not copied(locked)  # nothing started, nothing copied
    assert locked.engine.current is serving
    # watching and "Show command" stay open; chatting too
    assert "--model_name_or_path tiny" in caller("train_command", *run_form(locked.tab))
    assert caller.client.predict("hi!", "none", "", api_name="/chat")[0].strip()


def test_a_login_is_the_browser_token_not_the_session(locked):
    caller = Caller(locked.url)
    with pytest.raises(AppError, match="Wrong password"):
        caller("train_login", "s3cret")
    markdown, box = caller("train_login", PASSWORD)
    assert markdown.startswith("🔓 **Logged in**") and box == "" and caller.token
    with pytest.raises(AppError, match="no run is running"):  # past the login check
        caller("train_stop")
    other = Caller(locked.url)  # another browser: not logged in
    with pytest.raises(AppError, match="log in first"):
        other("train_stop")
    # Another connection replaying this browser's session hash, without its token: refused (the
    # login used to be gradio's session state, so the client-chosen hash was the login).
    thief = Caller(locked.url)
    thief.client.session_hash = caller.client.session_hash
    with pytest.raises(AppError, match="log in first"):
        thief("train_stop")
    stolen = caller.token
    caller("train_logout")  # ends the login everywhere: the old token replayed is refused
    assert caller.token is None
    with pytest.raises(AppError, match="log in first"):
        Caller(locked.url, token=stolen)("train_stop")


def test_nothing_configured_refuses_everyone(open_app, upload_file):
    caller = Caller(open_app.url)
    with pytest.raises(AppError, match="not configured"):
        caller("train_login", "anything")
    for api_name, args in guarded_calls(open_app, upload_file).items():
        with pytest.raises(AppError, match="no login is configured"):
            caller(api_name, *args)
    assert all("no login is configured" in text for text in refused_uploads(caller, upload_file))
    serving = open_app.engine.current
    assert "no login is configured" in caller("load_model", str(DEMO_DIR), "")
    assert open_app.engine.current is serving
    assert open_app.tab.manager.runs() == [] and not copied(open_app)
    assert caller.client.predict("hi!", "none", "", api_name="/chat")[0].strip()


def test_the_password_never_reaches_a_page(locked):
    caller = Caller(locked.url)
    caller("train_login", PASSWORD)
    for path in ("/", "/config"):
        assert PASSWORD not in httpx.get(locked.url.rstrip("/") + path, timeout=10).text


def test_uploads_over_the_limit_are_refused_by_gradio(locked, tmp_path):
    assert locked.demo.max_file_size == MAX_UPLOAD_BYTES
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as fh:
        fh.truncate(MAX_UPLOAD_BYTES + 1)
    with open(big, "rb") as fh:
        response = httpx.post(
            locked.url.rstrip("/") + "/gradio_api/upload", files={"files": ("big.jsonl", fh)}, timeout=60
        )
    assert response.status_code == 413, response.text


# --------------------------------------------------------------------------- logged in


@pytest.mark.parametrize("name", ["json", "text", "parquet"])
def test_a_loader_name_in_the_hub_dataset_box_is_refused_before_any_run(locked, name):
    """The datasets library's loader names read the server's working tree (issue 28): refused."""
    caller = Caller(locked.url)
    caller("train_login", PASSWORD)
    before = locked.tab.manager.runs()
    with pytest.raises(AppError, match="built-in loaders, which read local files.*upload it"):
        caller("train_start", *run_form(locked.tab, data_source="hub", hub_dataset=name))
    assert locked.tab.manager.runs() == before


def test_logged_in_session_uploads_trains_and_serves_the_new_model(locked, upload_file):
    caller = Caller(locked.url)
    caller("train_login", PASSWORD)

    preview, _ = caller("train_upload_train", handle_file(str(upload_file)), "chatbot: ")
    assert "**dialogues.jsonl**: 187 rows, valid" in preview and "```text\nchatbot: " in preview
    copies = list(locked.data.rglob("train.jsonl"))
    assert len(copies) == 1 and copies[0].read_bytes() == upload_file.read_bytes()

    message = caller("train_start", *run_form(locked.tab))
    run_id = locked.tab.manager.runs()[0]
    assert message.startswith(f"▶️ Started run **{run_id}**")
    with pytest.raises(AppError, match=f"run {run_id} is still running"):
        caller("train_start", *run_form(locked.tab))
    assert locked.tab.manager.runs() == [run_id]

    deadline = time.monotonic() + TIMEOUT
    while (status := locked.tab.manager.status(run_id)).state in ("running", "stopping"):
        assert time.monotonic() < deadline, status.log_tail
        time.sleep(0.5)
    assert status.state == "finished", status.error or status.log_tail
    assert status.loss_points and status.eval_bleu is not None
    final = status.final_dir

    # another viewer (not logged in) opening the page sees the same run, and so does a restarted app
    shown = Caller(locked.url)("on_page_load")
    run_text = next(v for v in shown if isinstance(v, str) and v.startswith("✅ **Run"))
    assert f"**Run {run_id}**: finished" in run_text and f"BLEU {status.eval_bleu:.2f}" in run_text
    restarted = train_handlers.TrainTab.create(auth=locked.tab.auth, runs_root=locked.runs)
    assert f"**Run {run_id}**: finished" in train_view.live_view(restarted, None)[1]
    assert final in [spec for _, spec in chat_handlers.picker_choices(locked.runs)]
    with pytest.raises(AppError, match="no run is running"):
        caller("train_stop")

    # the Chat tab: Refresh, then Load the new checkpoint (a logged-in action), then chat with it
    caller("refresh_models")
    # The run evaluated 8 rows with 1 beam, the demo model all 187 with 4: the figures are not compared
    # (the guard against a worse model asked for a second Load after every retrain), the Load serves it.
    loaded = caller("load_model", final, "")
    assert loaded.startswith("✅ Now serving") and "measured differently" in loaded, loaded
    assert locked.engine.current.name == final
    assert caller.client.predict("hi! how are you?", "none", "", api_name="/chat")[0].strip()
    # a push needs the Hub: offline it fails with the reason, and the app keeps serving
    with pytest.raises(AppError, match="could not push"):
        caller("train_push", "someone/chat-e", False, False)
    assert caller.client.predict("still there?", "none", "", api_name="/chat")[0].strip()
