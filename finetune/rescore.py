"""``python -m finetune.rescore MODEL_DIR``: measure a saved model's validation BLEU again, another
way, and record it; the weights are not touched.

A figure is comparable only with figures measured the same way (``finetune.measure``). This
evaluates a finished model folder (a run's ``final/``, the bundled demo model) on the validation
rows its training_args.json names, with the evaluation settings of the Train tab's runs (the
app's preset; each can be overridden by its training flag), and rewrites the folder's
all_results.json: the new ``eval_bleu`` / ``eval_loss`` / per-kind figures, ``eval_measure``
(what they were measured on) and ``rescored`` (the figures they replace and their measure), and
the model card's evaluation line. One process, CPU or one GPU, the training code's own
``evaluate``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import time
from pathlib import Path

from chat.layout import RESULTS_FILE, TRAINING_ARGS_FILE
from finetune.measure import MEASURE_FIELDS, describe, measure_of, saved_measure

log = logging.getLogger("finetune.rescore")

# The evaluation settings a rescoring may change (the data and the input are the model's own).
# The first five default to the app's (the Train tab's runs: finetune.jobs.spec.app_config); the
# others to the model's own training_args.json.
APP_FIELDS = (
    "num_beams",
    "val_min_target_length",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "repetition_penalty",
)
EVAL_FIELDS = (*APP_FIELDS, "val_max_target_length", "n_val", "per_device_eval_batch_size")


def rescore_config(folder: Path, **overrides):
    """The TrainConfig to evaluate ``folder`` with: its training_args.json's data, input and
    lengths, the app's evaluation settings (APP_FIELDS), then ``overrides`` (None: not given)."""
    from finetune.config import TrainConfig
    from finetune.jobs.spec import app_config

    trained = json.loads((folder / TRAINING_ARGS_FILE).read_text())
    app = app_config(trained.get("model_name_or_path") or "tiny", dataset_name="sample")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {name: value for name, value in trained.items() if name in known}
    values.update({name: getattr(app, name) for name in APP_FIELDS})
    values.update({name: value for name, value in overrides.items() if value is not None})
    longest = values.get("val_max_target_length") or values.get("max_target_length") or app.max_target_length
    values["val_min_target_length"] = min(values["val_min_target_length"], longest)  # as make_config does
    values.update(model_name_or_path=str(folder), output_dir=str(folder), resume_from_checkpoint=None)
    return TrainConfig(**values)


def evaluate_folder(folder: Path, cfg) -> dict:
    """``finetune.evaluate.evaluate`` of the model in ``folder`` on cfg's validation rows."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import DataCollatorForSeq2Seq

    from chat.model import load_model, load_tokenizer
    from finetune.data import load_raw, tokenize
    from finetune.evaluate import evaluate

    accelerator = Accelerator()
    tokenizer = load_tokenizer(str(folder))
    raw = load_raw(dataclasses.replace(cfg, n_train=1, feedback_file=None, feedback_validation_file=None))
    raw.pop("train")
    data = tokenize(raw, tokenizer, cfg)
    model = load_model(str(folder))
    loader = DataLoader(
        data["validation"],
        batch_size=cfg.per_device_eval_batch_size,
        collate_fn=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100),
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    model, loader = accelerator.prepare(model, loader)
    return evaluate(accelerator, model, loader, tokenizer, cfg)


def record(folder: Path, cfg, results: dict, before: dict | None) -> dict:
    """all_results.json with the new figures, how they were measured and what they replace (the
    old figures and their measure ``before``), written whole by a rename; and the model card's
    evaluation line. Returns the new all_results."""
    path = folder / RESULTS_FILE
    old = json.loads(path.read_text()) if path.is_file() else {}
    figure = ("eval_bleu", "eval_rows_", "eval_loss")
    kept = {k: v for k, v in old.items() if not k.startswith(figure) and k not in ("eval_measure", "rescored")}
    new = {
        **{k: v for k, v in results.items() if k.startswith(figure)},
        "eval_samples": results["eval_samples"],
        **kept,
        "eval_measure": {name: getattr(cfg, name) for name in MEASURE_FIELDS},
        "rescored": {
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "previous": {k: v for k, v in old.items() if k.startswith(("eval_bleu", "eval_loss"))},
            "previous_measure": before,
        },
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(new, indent=2) + "\n")
    os.replace(tmp, path)
    card = folder / "README.md"
    if card.is_file():
        measured = describe(measure_of(new["eval_measure"]), new["eval_samples"])
        line = (
            f"- Evaluation: sacreBLEU {round(new['eval_bleu'], 2)} on {new['eval_samples']} validation rows\n"
            f"  (measured again, the weights unchanged: {measured})\n"
        )
        text = re.sub(r"- Evaluation: .*?\n(?:  .*\n)?", lambda _: line, card.read_text(), count=1)
        card.write_text(text)
    return new


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m finetune.rescore", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a model folder with training_args.json (a run's final/, chat/demo_model)")
    for name in EVAL_FIELDS:
        parser.add_argument(f"--{name}", type=float if name == "repetition_penalty" else int, default=None)
    args = vars(parser.parse_args(argv))
    folder = Path(args.pop("folder"))
    if not (folder / TRAINING_ARGS_FILE).is_file():
        parser.error(f"{folder}: no {TRAINING_ARGS_FILE} (it says which validation rows and input to use)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = rescore_config(folder, **args)
    before = saved_measure(folder)
    new = record(folder, cfg, evaluate_folder(folder, cfg), before)
    log.info(
        "%s: BLEU %.2f on %s (was %s on %s)",
        folder,
        new["eval_bleu"],
        describe(measure_of(new["eval_measure"]), new["eval_samples"]),
        new["rescored"]["previous"].get("eval_bleu", "?"),
        describe(before),
    )
    return new


if __name__ == "__main__":
    main()
