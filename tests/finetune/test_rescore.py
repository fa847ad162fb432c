"""python -m finetune.rescore: a saved model's BLEU measured again another way, recorded with how it
was measured; the weights are not touched (issue 28, item 9)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from chat.layout import DEMO_DIR
from finetune import rescore
from finetune.measure import describe, measure_of, saved_measure


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def demo(tmp_path):
    folder = tmp_path / "demo"
    shutil.copytree(DEMO_DIR, folder)
    return folder


def test_rescoring_with_the_runs_own_settings_gives_back_its_figure(demo):
    """The check of the tool itself: the demo model's training evaluation (2 processes, min length 1,
    no n-gram blocking) recorded 60.0; measured again in one process with those settings, the same."""
    recorded = json.loads((DEMO_DIR / "all_results.json").read_text())["rescored"]
    weights = sha(demo / "model.safetensors")
    settings = recorded["previous_measure"]
    new = rescore.main(
        [
            str(demo),
            *("--val_min_target_length", str(settings["val_min_target_length"])),
            *("--no_repeat_ngram_size", str(settings["no_repeat_ngram_size"])),
            *("--encoder_no_repeat_ngram_size", str(settings["encoder_no_repeat_ngram_size"])),
            *("--repetition_penalty", str(settings["repetition_penalty"])),
        ]
    )
    assert new["eval_bleu"] == pytest.approx(recorded["previous"]["eval_bleu"], abs=0.05)
    assert measure_of(new["eval_measure"]) == measure_of(settings) == saved_measure(demo)
    assert sha(demo / "model.safetensors") == weights  # the weights are not touched
    assert json.loads((demo / "all_results.json").read_text()) == new  # written whole
    assert new["train_samples"] == 1423 and new["num_processes"] == 2  # what the run recorded besides stays


def test_rescoring_with_the_apps_settings_records_the_figure_and_its_measure(demo):
    new = rescore.main([str(demo)])
    committed = json.loads((DEMO_DIR / "all_results.json").read_text())
    assert new["eval_bleu"] == pytest.approx(committed["eval_bleu"], abs=0.05)  # what chat/demo_model records
    assert new["eval_measure"] == committed["eval_measure"]
    assert new["rescored"]["previous"]["eval_bleu"] == pytest.approx(committed["eval_bleu"])
    assert {f"eval_bleu_{kind}" for kind in ("persona", "emotion", "task", "topic", "none")} <= set(new)
    card = (demo / "README.md").read_text()
    assert f"sacreBLEU {round(new['eval_bleu'], 2)} on 187 validation rows" in card
    assert describe(saved_measure(demo), 187) in card


def test_a_folder_without_training_args_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        rescore.main([str(tmp_path)])
    assert "no training_args.json" in capsys.readouterr().err
