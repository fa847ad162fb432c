"""LoRA runs in finetune/jobs: a spec's adapter settings reach the CLI exactly, run.json keeps them,
a finished adapter run is a base to continue, listed with its kind, and pushed as the adapter or as
the merged model."""

import json

import pytest
from jobs_helpers import launcher_args, spec
from test_lora import random_adapter, save_adapter

from chat.layout import DEMO_DIR
from finetune.config import parse_args
from finetune.hub import HubError
from finetune.jobs.command import build_command, run_config
from finetune.jobs.manager import MERGED, RunManager
from finetune.jobs.spec import JobSpec, checked_model, make_config


def adapter_run(root, run_id="20250101-000000-abcdef", base="tiny"):
    """A finished LoRA run's folder, as the Train tab lists it (run.json, final/ of an adapter)."""
    final = root / run_id / "final"
    save_adapter(random_adapter(base), final)
    (final / "all_results.json").write_text(json.dumps({"eval_bleu": 3.25}))
    (root / run_id / "run.json").write_text("{}")
    return final


def test_a_lora_spec_reaches_the_cli_flag_for_flag(roots, tmp_path):
    made = spec(adapter="lora", lora_r=16, lora_alpha=32, lora_dropout=0.1, lora_target_modules="q_proj,v_proj")
    argv = build_command(made, tmp_path / "run")
    flags = launcher_args(argv).training_script_args
    at = flags.index("--adapter")
    assert flags[at : at + 10] == [
        *("--adapter", "lora", "--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0.1"),
        *("--lora_target_modules", "q_proj,v_proj"),
    ]
    assert parse_args(flags) == run_config(made, tmp_path / "run")
    # run.json keeps the modules as a JSON list and gives back the same spec
    stored = json.loads(json.dumps(made.to_dict()))
    assert stored["config"]["lora_target_modules"] == ["q_proj", "v_proj"]
    assert JobSpec.from_dict(stored).config == made.config
    # full fine-tuning says so (a run's command gives every setting, the defaults too)
    full = launcher_args(build_command(spec(), tmp_path)).training_script_args
    at = full.index("--adapter")
    assert full[at : at + 2] == ["--adapter", "none"] and parse_args(full).adapter == "none"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"adapter": "lora", "lora_r": 2048}, "lora_r must be at most 1,024"),
        ({"adapter": "lora", "lora_r": 2.5}, "lora_r must be a whole number"),
        ({"adapter": "lora", "lora_target_modules": ["q_proj", "oops"]}, "unknown module(s) oops"),
        ({"adapter": "lora", "lora_dropout": 1.0}, "lora_dropout must be >= 0 and < 1"),
        ({"lora_r": 4}, "--lora_r needs --adapter lora"),
    ],
)
def test_bad_adapter_settings_are_refused_by_name(roots, changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec(**changes)


def test_a_finished_adapter_run_is_a_base_to_continue(roots):
    runs, _ = roots
    manager = RunManager(runs)
    final = adapter_run(runs)
    assert checked_model(str(final)) == str(final.resolve())
    continued = spec(str(final))
    assert continued.config.adapter == "lora" and continued.config.lora_r == 4  # the adapter's own settings
    assert (str(final.resolve()),) == tuple(p for _, p in manager.finished_runs())
    assert manager.finished_runs()[0][0] == "20250101-000000-abcdef (BLEU 3.2, LoRA adapter)"
    # an adapter whose base the app may not load (a folder outside the allowed ones) is refused
    config = json.loads((final / "adapter_config.json").read_text())
    (final / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/etc"}))
    with pytest.raises(ValueError, match="outside the allowed folders"):
        checked_model(str(final))


def test_an_adapter_on_the_demo_model_is_a_base_too(roots):
    runs, _ = roots
    final = adapter_run(runs, base=str(DEMO_DIR.resolve()))
    made = JobSpec(make_config(model_name_or_path=str(final), dataset_name="sample"))
    assert made.config.adapter == "lora" and made.config.model_name_or_path == str(final.resolve())


def test_push_sends_the_adapter_or_the_merged_model(roots, monkeypatch):
    runs, _ = roots
    manager = RunManager(runs)
    final = adapter_run(runs)
    pushed = []

    def fake_push(folder, repo_id, private=False):  # the Hub is offline here: record what would go up
        pushed.append(sorted(p.name for p in folder.iterdir()))
        raise HubError(f"could not push {folder} to {repo_id} (offline)", file=str(folder))

    monkeypatch.setattr("finetune.hub.push", fake_push)
    with pytest.raises(HubError):
        manager.push(final.parent.name, "me/bot")
    assert "adapter_model.safetensors" in pushed[-1] and "model.safetensors" not in pushed[-1]
    with pytest.raises(HubError):
        manager.push(final.parent.name, "me/bot", merged=True)
    assert "model.safetensors" in pushed[-1] and "config.json" in pushed[-1]
    assert (final.parent / MERGED / "model.safetensors").is_file()  # made once, kept for the next push
    full = runs / "20250102-000000-abcdef"
    (full / "final").mkdir(parents=True)
    (full / "run.json").write_text("{}")
    (full / "final" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="there is no adapter to merge"):
        manager.push(full.name, "me/bot", merged=True)
