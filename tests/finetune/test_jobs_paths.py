"""finetune/jobs/paths.py: local paths in a spec must resolve inside the allowed roots."""

import pytest
from jobs_helpers import good_rows, launcher_args, spec, write_jsonl

from chat.layout import ROOT
from finetune.config import parse_args
from finetune.jobs import paths
from finetune.jobs.command import build_command
from finetune.jobs.manager import RunManager

OUTSIDE = ["../../etc/passwd", "/etc/passwd", "/etc", "~/.bashrc", "data/../../../etc/hosts"]


@pytest.mark.parametrize("field", ["model", "split_train_file"])
@pytest.mark.parametrize("value", OUTSIDE)
def test_paths_outside_allowed_roots_are_refused(roots, field, value):
    with pytest.raises(ValueError, match="outside the allowed folders"):
        spec(**{field: value})


@pytest.mark.parametrize("value", OUTSIDE)
def test_a_dataset_name_is_never_a_path(roots, value):
    with pytest.raises(ValueError, match="is not 'sample' or a Hub dataset id"):
        spec(dataset_name=value)


def test_train_files_outside_allowed_roots_are_refused(roots):
    _, uploads = roots
    inside = write_jsonl(uploads / "val.jsonl", good_rows(3))
    for train, val in (("/etc/passwd", str(inside)), (str(inside), "/etc/hosts")):
        with pytest.raises(ValueError, match="outside the allowed folders"):
            spec(train_file=train, validation_file=val)


def test_symlink_out_of_an_allowed_root_is_refused(roots, tmp_path):
    _, uploads = roots
    secret = write_jsonl(tmp_path / "secret.jsonl", good_rows(3))
    (uploads / "link.jsonl").symlink_to(secret)
    with pytest.raises(ValueError, match="outside the allowed folders"):
        spec(split_train_file=str(uploads / "link.jsonl"))


def test_local_files_inside_roots(roots, tmp_path, monkeypatch):
    _, uploads = roots
    train = write_jsonl(uploads / "train.jsonl", good_rows(20))
    val = write_jsonl(uploads / "val.jsonl", good_rows(4))
    made = spec(train_file=str(train), validation_file=str(val))
    cfg = parse_args(launcher_args(build_command(made, tmp_path)).training_script_args)
    assert (cfg.train_file, cfg.validation_file, cfg.dataset_name) == (str(train), str(val), "smangrul/MuDoConv")
    # relative to the working directory, like the app's default roots
    monkeypatch.chdir(uploads.parent)
    assert spec(split_train_file="uploads/train.jsonl").split_train_file == str(train)
    # the shipped sample by path; a model folder must hold a checkpoint
    assert spec(split_train_file="data/sample/train.jsonl").split_train_file == str(ROOT / "data/sample/train.jsonl")
    with pytest.raises(ValueError, match="not a model folder"):
        spec(model=str(uploads))
    with pytest.raises(ValueError, match="no such file"):
        spec(split_train_file=str(uploads / "missing.jsonl"))
    (uploads / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported file type"):
        spec(split_train_file=str(uploads / "notes.txt"))
    with pytest.raises(ValueError, match="replaces train_file/validation_file"):
        spec(split_train_file=str(train), train_file=str(train), validation_file=str(val))
    # a local file is data to upload, never a dataset name (the CLI would read any local path)
    with pytest.raises(ValueError, match="is not 'sample' or a Hub dataset id"):
        spec(dataset_name=str(train))
    # a Hub id stays a Hub id
    hub = spec("facebook/blenderbot-400M-distill", dataset_name="nobody/nothing")
    assert hub.config.dataset_name == "nobody/nothing"


def test_every_manager_root_is_allowed(roots, tmp_path):
    other = tmp_path / "elsewhere" / "runs"
    final = other / "20250101-000000-abcdef" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="outside the allowed folders"):
        spec(model=str(final))
    RunManager(other)  # the app's runs root may be given explicitly
    assert other.resolve() in paths.allowed_roots()
    assert spec(model=str(final)).config.model_name_or_path == str(final.resolve())
