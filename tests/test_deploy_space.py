"""scripts/deploy_space.py, offline: which files a Space gets, and that the upload is the same
list with the token kept out of every output. HfApi is replaced: no test touches the network."""

from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

from chat.layout import DEMO_DIR, ROOT

_spec = importlib.util.spec_from_file_location("deploy_space", ROOT / "scripts" / "deploy_space.py")
deploy_space = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deploy_space)

LEFT_OUT = ("bench/", "tests/", "docs/", "scripts/", "runs/", "data/uploads/", ".git/", ".ci/")


def test_dry_run_lists_the_app_and_nothing_else(capsys):
    assert deploy_space.main(["--repo_id", "someone/chat-e", "--dry-run"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == deploy_space.files_to_upload()
    for path in (
        "app.py",
        "requirements.txt",
        "README.md",
        "chat/engine.py",
        "finetune/config.py",
        "webui/auth.py",
        "configs/ds_zero2.json",
        "data/sample/train.jsonl",
    ):
        assert path in listed
    demo = {f"chat/demo_model/{p.name}" for p in DEMO_DIR.iterdir() if p.is_file()}
    assert "chat/demo_model/model.safetensors" in demo and demo <= set(listed)
    for package in ("chat/", "finetune/", "webui/", "configs/"):
        assert any(p.startswith(package) for p in listed)
    assert not [p for p in listed if p.startswith(LEFT_OUT) or "__pycache__" in p or p.endswith(".pyc")]


def test_ignore_patterns_apply_at_any_depth(tmp_path):
    kept = ["app.py", "chat/engine.py", "data/sample/train.jsonl"]
    dropped = [
        "bench/chat.py",
        "tests/test_x.py",
        "docs/a.md",
        "scripts/deploy_space.py",
        "runs/r1/final/x.bin",
        "data/uploads/u.jsonl",
        ".git/config",
        ".ci/run",
        ".env",
        "chat/.env.local",
        "chat/__pycache__/e.pyc",
        "__pycache__/app.cpython-311.pyc",
        "stray.pyc",
        "webui/.cache/huggingface/x",
    ]
    for path in kept + dropped:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("x")
    assert deploy_space.files_to_upload(tmp_path) == sorted(kept)


@pytest.fixture
def hub_calls(monkeypatch) -> list:
    """Replace HfApi by a recorder: the calls it would have made, and no network."""
    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))
            kwargs["ignore_patterns"] += DEFAULT_IGNORE_PATTERNS  # as huggingface_hub does, in place
            return SimpleNamespace(commit_url=f"https://huggingface.co/spaces/{kwargs['repo_id']}/commit/abc")

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    return calls


def test_upload_sends_the_dry_run_list_and_never_shows_the_token(monkeypatch, hub_calls, capsys, caplog):
    token = "hf_NotARealTokenButSecret123"
    monkeypatch.setenv("HF_TOKEN", token)
    caplog.set_level(logging.DEBUG)
    assert deploy_space.main(["--repo_id", "someone/chat-e"]) == 0
    (_, repo_id, create), (_, upload) = hub_calls
    assert repo_id == "someone/chat-e" and create["repo_type"] == "space" and create["exist_ok"]
    assert upload["repo_type"] == "space" and upload["repo_id"] == "someone/chat-e"
    assert upload["folder_path"] == ROOT
    # What upload_folder keeps with these patterns (ours plus its defaults) is the dry-run list.
    paths = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("**/*") if p.is_file())
    assert list(filter_repo_objects(paths, ignore_patterns=upload["ignore_patterns"])) == deploy_space.files_to_upload()
    assert tuple(upload["delete_patterns"]) == deploy_space.IGNORE_PATTERNS  # the constant itself is untouched
    out = capsys.readouterr()
    assert "someone/chat-e/commit/abc" in out.out
    assert token not in out.out + out.err + caplog.text


def test_no_token_stops_before_any_call(monkeypatch, hub_calls):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(SystemExit, match="HF_TOKEN"):
        deploy_space.main(["--repo_id", "someone/chat-e"])
    assert hub_calls == []


@pytest.mark.parametrize("argv", [[], ["--repo_id", "chat-e", "--dry-run"], ["--repo_id", "a/b/c", "--dry-run"]])
def test_repo_id_is_required_as_user_slash_name(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        deploy_space.main(argv)
    assert exit.value.code == 2 and "repo_id" in capsys.readouterr().err
