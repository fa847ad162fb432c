"""The context score inside evaluation (issue 30, item 2): computed from the replies evaluation
generated for BLEU, by the evaluated model or a fixed ``--context_scorer``; carried by the eval
event, all_results.json, the model card and the trackers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from chat.layout import DEMO_DIR, ROOT
from chat.model import load_model, load_tokenizer
from finetune.config import TrainConfig
from finetune.context_score import context_score
from finetune.evaluate import scores, without_prefix
from finetune.jobs.spec import JobSpec, make_config
from finetune.rescore import evaluate_folder


def test_the_scorer_flag_is_checked():
    assert TrainConfig(dataset_name="sample").context_scorer is None
    assert TrainConfig(dataset_name="sample", context_scorer=" tiny ").context_scorer == "tiny"
    assert TrainConfig(dataset_name="sample", context_scorer=str(DEMO_DIR)).context_scorer == str(DEMO_DIR)
    assert TrainConfig(dataset_name="sample", context_scorer="facebook/blenderbot-400M-distill").context_scorer
    for bad in ("no such model", "", "/nowhere/model"):
        with pytest.raises(ValueError, match="--context_scorer must be a preset, a Hub id or a model folder"):
            TrainConfig(dataset_name="sample", context_scorer=bad)


def test_an_app_run_may_score_only_with_a_model_it_may_load(roots, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text("{}")  # a model folder, but not under an allowed root
    with pytest.raises(ValueError, match="outside the allowed folders"):
        JobSpec(make_config(model_name_or_path="tiny", context_scorer=str(outside)))
    assert JobSpec(make_config(model_name_or_path="tiny", context_scorer="tiny")).config.context_scorer == "tiny"


@pytest.fixture(scope="module")
def demo_eval(tmp_path_factory):
    """The demo model evaluated on 100 of the sample's validation rows, every sample kept."""
    cfg = TrainConfig(
        model_name_or_path=str(DEMO_DIR),
        dataset_name="sample",
        n_val=100,
        num_beams=1,
        val_min_target_length=1,
        per_device_eval_batch_size=50,
        n_val_batch_generations=10,
        output_dir=str(tmp_path_factory.mktemp("eval")),
    )
    return cfg, evaluate_folder(DEMO_DIR, cfg)


def test_evaluation_scores_the_replies_it_generated_with_the_evaluated_model(demo_eval):
    cfg, results = demo_eval
    assert len(results["samples"]) == results["eval_samples"] == 100
    # The same figures as the score of the generated replies computed apart, from those replies.
    prompts = [without_prefix(s["prompt"], cfg.source_prefix) for s in results["samples"]]
    predictions, references = (
        [s["prediction"] for s in results["samples"]],
        [s["reference"] for s in results["samples"]],
    )
    model, tokenizer = load_model(str(DEMO_DIR)).eval(), load_tokenizer(str(DEMO_DIR))
    apart = context_score(model, tokenizer, prompts, predictions, references, cfg)
    ours = {k: v for k, v in results.items() if k.startswith("eval_context_") and k != "eval_context_seconds"}
    assert ours == pytest.approx(apart)
    assert results["eval_context_rows"] >= 60  # rows with a context (none-kind rows have none)
    assert results["eval_context_hits"] > 2 * results["eval_context_chance"]  # the demo model: well above 0.2
    assert {"eval_context_hits_persona", "eval_context_hits_gold", "eval_context_seconds"} <= set(scores(results))
    assert 0 < results["eval_context_seconds"] < results["eval_seconds"]


def test_a_fixed_scorer_scores_the_same_replies_on_its_own_scale(demo_eval):
    cfg, results = demo_eval
    fixed = evaluate_folder(DEMO_DIR, dataclasses.replace(cfg, context_scorer="tiny"))
    assert fixed["eval_bleu"] == results["eval_bleu"]  # the same replies
    assert fixed["eval_context_rows"] == results["eval_context_rows"]
    # The tiny preset is untrained: the context hardly moves its likelihoods (near chance, unlike the demo model).
    assert fixed["eval_context_hits"] < results["eval_context_hits"] - 0.2


def test_a_run_carries_the_score_to_its_events_results_card_and_tracker(tiny_path, tmp_path):
    out = tmp_path / "run"
    args = "--model_name_or_path tiny --dataset_name sample --n_train 16 --n_val 60 --num_beams 1 --max_train_steps 2"
    args += " --val_min_target_length 2 --per_device_eval_batch_size 30 --with_tracking --report_to tensorboard"
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", *args.split(), "--output_dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [e for e in events if e["event"] == "eval"][-1]
    results = json.loads((out / "all_results.json").read_text())
    assert last["eval_context_rows"] == results["eval_context_rows"] > 0
    carried = {k for k in last if k.startswith("eval_context_")}
    assert {"eval_context_hits", "eval_context_hits_gold", "eval_context_chance", "eval_context_seconds"} <= carried
    assert any(k.startswith("eval_context_hits_") and "gold" not in k for k in carried)  # per kind
    assert {k: results[k] for k in carried} == {k: last[k] for k in carried}
    assert "Context score" in (out / "final" / "README.md").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = [EventAccumulator(str(p.parent)).Reload() for p in out.rglob("events.out.tfevents.*")]
    tags = {tag for acc in logs for tag in acc.Tags()["scalars"]}
    assert {"eval_context_hits", "eval_context_hits_gold", "eval_bleu"} <= tags
