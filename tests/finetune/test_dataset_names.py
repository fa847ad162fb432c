"""A dataset name is 'sample' or a Hub dataset id, never a way to read the server's files (issue 28
item 3): datasets.load_dataset also takes the names of its built-in loaders (json, csv, text,
parquet, ...), which read data files from the working directory, and local folders. The CLI and
the run spec the Train tab builds refuse them (the tab's form: tests/webui/test_train_handlers.py)."""

import pkgutil

import pytest
from datasets import packaged_modules
from jobs_helpers import spec

from finetune.config import TrainConfig, parse_args

# The loader names datasets itself lists (its package of packaged modules), not a list of ours.
LOADERS = sorted({m.name for m in pkgutil.iter_modules(packaged_modules.__path__)})


def test_the_common_loader_names_are_among_them():
    assert {"json", "csv", "text", "parquet", "arrow", "pandas", "imagefolder", "webdataset"} <= set(LOADERS)


@pytest.mark.parametrize("name", [*LOADERS, "JSON", "Csv"])
def test_a_loader_name_is_refused_by_the_config_and_the_cli(name, capsys):
    with pytest.raises(ValueError, match="built-in loaders, which read local files"):
        TrainConfig(dataset_name=name)
    with pytest.raises(SystemExit) as exc:  # a usage error before anything loads
        parse_args(["--dataset_name", name])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not a Hub dataset" in err and "--train_file" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["json", "text", "parquet", "csv", "PARQUET"])
def test_a_loader_name_is_refused_by_the_run_spec(roots, name):
    with pytest.raises(ValueError, match="built-in loaders"):
        spec(dataset_name=name)


@pytest.mark.parametrize(
    "name",
    ["hf://datasets/json", "hf://datasets/user/name", "buckets/user/bucket/dir", "../data", "/etc", "~/data", "a/b/c"],
)
def test_urls_and_paths_are_no_dataset_names(roots, name):
    with pytest.raises(ValueError, match="is not 'sample' or a Hub dataset id"):
        TrainConfig(dataset_name=name)
    with pytest.raises(ValueError, match="is not 'sample' or a Hub dataset id"):
        spec(dataset_name=name)


def test_a_local_folder_is_not_read_as_the_hub_dataset_of_its_name(roots, tmp_path, monkeypatch):
    (tmp_path / "someone" / "chats").mkdir(parents=True)
    (tmp_path / "someone" / "chats" / "train.jsonl").write_text('{"texts": "x", "labels": "y"}\n')
    (tmp_path / "notes").write_text("secret")
    monkeypatch.chdir(tmp_path)
    for name, what in (("someone/chats", "folder"), ("notes", "file")):
        with pytest.raises(ValueError, match=f"is a local {what}, which datasets would read instead of the Hub"):
            TrainConfig(dataset_name=name)
    assert TrainConfig(dataset_name="someone/else").dataset_name == "someone/else"  # a Hub id stays one


def test_hub_ids_and_the_sample_pass_and_a_train_file_makes_the_name_moot():
    for name in ("smangrul/MuDoConv", "sample", "user/json", "jsonish"):
        assert TrainConfig(dataset_name=name).dataset_name == name
    cfg = TrainConfig(dataset_name="json", train_file="t.jsonl", validation_file="v.jsonl")  # not used
    assert cfg.train_file == "t.jsonl"
