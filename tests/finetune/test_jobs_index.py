"""The runs index (finetune/jobs/index.py): every folder under the runs root as one record, with
lineage, scores and settings; foreign, corrupt and half-written folders listed as such."""

import json
import time

from chat.layout import FINAL
from finetune.checkpoint import MetricsWriter
from finetune.jobs.index import curves, differing_settings, list_runs, read_record


def cli_run(root, name, base="tiny", bleu=(10.0, 12.5), done=True, **settings):
    """A run folder as ``python -m finetune --output_dir ROOT/NAME`` leaves it (its writer's events)."""
    folder = root / name
    metrics = MetricsWriter(folder, enabled=True)
    metrics.write("start", total_steps=20, train_samples=1423, eval_samples=187, resumed_at=0)
    for step, value in zip((10, 20), bleu):
        metrics.write("log", step=step, loss=3.0 - step / 10)
        metrics.write(
            "eval", step=step, eval_bleu=value, eval_loss=2.5, eval_bleu_persona=value + 1, eval_context_hits=0.6
        )
    if done:
        final = folder / FINAL
        final.mkdir()
        (final / "config.json").write_text("{}")
        (final / "model.safetensors").write_bytes(b"")  # a complete model folder: config and weights
        args = {"model_name_or_path": base, "dataset_name": "sample", "learning_rate": 1e-3, "output_dir": str(folder)}
        (final / "training_args.json").write_text(json.dumps({**args, **settings}))
        metrics.write("done", step=20, final=str(final), eval_bleu=bleu[-1])
    return folder


def test_finished_runs_with_lineage_scores_and_settings(tmp_path):
    first = cli_run(tmp_path, "first")
    cli_run(tmp_path, "second", base=str(first / FINAL), learning_rate=5e-4, adapter="lora", lora_r=8)
    records = {r.run_id: r for r in list_runs(tmp_path)}
    a, b = records["first"], records["second"]
    assert a.state == b.state == "finished" and a.final_dir == str(first / FINAL)
    assert (a.bleu, a.best_bleu, a.bleu_parts["persona"], a.context_hits) == (12.5, 12.5, 13.5, 0.6)
    assert (a.train_rows, a.eval_rows, a.data, a.base, a.parent) == (1423, 187, "sample", "tiny", None)
    assert b.parent == "first" and b.adapter == "lora" and a.adapter == "none" and b.objective == "sft"
    assert "output_dir" not in a.settings  # differs between any two runs, says nothing
    assert differing_settings([a, b]) == {
        "adapter": [None, "lora"],
        "learning_rate": [1e-3, 5e-4],
        "lora_r": [None, 8],
        "model_name_or_path": ["tiny", str(first / FINAL)],
    }
    assert a.duration_s is not None and a.duration_s >= 0


def test_best_bleu_is_the_highest_evaluation_not_the_last(tmp_path):
    cli_run(tmp_path, "dipped", bleu=(14.0, 11.0))
    (record,) = list_runs(tmp_path)
    assert (record.bleu, record.best_bleu) == (11.0, 14.0)


def test_foreign_corrupt_and_half_written_folders_are_listed_as_such(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not a run")
    corrupt = tmp_path / "20261203-101010-abcdef"
    corrupt.mkdir()
    (corrupt / "run.json").write_text("{half")
    stopped_midway = cli_run(tmp_path, "midway", done=False)
    with open(stopped_midway / "metrics.jsonl", "a") as fh:
        fh.write('{"event": "log", "step": 2')  # a line still being written
    (tmp_path / ".final.tmp").mkdir()  # hidden: not listed
    records = {r.run_id: r for r in list_runs(tmp_path)}
    assert set(records) == {"notes", "20261203-101010-abcdef", "midway"}
    assert records["notes"].state == "foreign" and "not a training run" in records["notes"].problem
    assert (
        records["20261203-101010-abcdef"].state == "corrupt"
        and "run.json unreadable" in records["20261203-101010-abcdef"].problem
    )
    assert records["midway"].state == "incomplete" and records["midway"].bleu == 12.5
    assert records["midway"].final_dir is None


def test_a_record_is_read_again_only_when_its_files_change(tmp_path):
    folder = cli_run(tmp_path, "run")
    (first,) = list_runs(tmp_path)
    (again,) = list_runs(tmp_path)
    assert again is first  # the cached record: nothing changed
    time.sleep(0.01)
    MetricsWriter(folder, enabled=True).write("pushed", repo="me/bot", url="https://hf.co/me/bot")
    (after,) = list_runs(tmp_path)
    assert after is not first and after.pushed_url == "https://hf.co/me/bot"


def test_curves_by_step(tmp_path):
    folder = cli_run(tmp_path, "run")
    found = curves(folder)
    assert found["loss"] == [{"step": 10, "value": 2.0}, {"step": 20, "value": 1.0}]
    assert [p["value"] for p in found["bleu"]] == [10.0, 12.5]
    assert [p["value"] for p in found["context_hits"]] == [0.6, 0.6]
    assert found["pref_accuracy"] == []


def test_an_app_run_takes_its_state_from_the_run_status(tmp_path):
    folder = cli_run(tmp_path, "20261203-111111-abcdef")
    (folder / "run.json").write_text(
        json.dumps(
            {
                "run_id": folder.name,
                "spec": {"config": {"model_name_or_path": "tiny", "dataset_name": "sample", "learning_rate": 0.002}},
                "label": "my bot",
            }
        )
    )
    record = read_record(folder, tmp_path)
    assert record.state == "finished" and record.name == "my bot" and record.settings["learning_rate"] == 0.002
