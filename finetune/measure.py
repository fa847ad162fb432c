"""How a BLEU figure was measured, so that only figures measured alike are compared.

BLEU depends on what is measured and how: the validation rows, the input (source prefix and
length) and the evaluation's generation settings (beams, minimum and maximum length, n-gram
blocking, repetition penalty). The bundled demo model was scored with a minimum length of 1 and
no n-gram blocking (60.0), runs of the Train tab with the CLI's 20 and 3 (22.8 for a better
model): side by side the two numbers said nothing, and the chat's guard against serving a worse
model asked for a second Load after every retrain.

A model folder records its measure: ``training_args.json`` holds the settings the run evaluated
with, and a figure computed again later (``python -m finetune.rescore``) carries its own
``eval_measure`` in ``all_results.json``, which wins. Two figures are comparable when their
measures are equal.
"""

from __future__ import annotations

import json
from pathlib import Path

from chat.layout import RESULTS_FILE, TRAINING_ARGS_FILE

# The settings a validation BLEU depends on (TrainConfig's names).
MEASURE_FIELDS = (
    "dataset_name",
    "validation_file",
    "n_val",
    "source_prefix",
    "max_source_length",
    "val_max_target_length",
    "val_min_target_length",
    "num_beams",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "repetition_penalty",
)


def measure_of(settings: dict) -> dict | None:
    """The measure in a run's settings (a training_args.json, a TrainConfig's ``to_dict()``), or
    None when a setting is missing (nothing to compare then). A run's own validation file counts
    by its name (an upload split into each run's folder is a different file per run)."""
    if not isinstance(settings, dict):
        return None
    values = dict(settings)
    if values.get("val_max_target_length") is None:  # the CLI's default: max_target_length
        values["val_max_target_length"] = values.get("max_target_length")
    if any(name not in values for name in MEASURE_FIELDS) or values["val_max_target_length"] is None:
        return None
    measure = {name: values[name] for name in MEASURE_FIELDS}
    if measure["validation_file"]:
        measure["validation_file"] = Path(str(measure["validation_file"])).name
    if measure["validation_file"]:  # a file replaces the dataset's validation split
        measure["dataset_name"] = None
    return measure


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def saved_measure(folder: str | Path | None) -> dict | None:
    """How the BLEU saved in a model folder was measured: its all_results.json's ``eval_measure``
    (a figure computed again), else its training_args.json; None when neither says."""
    if not folder:
        return None
    folder = Path(folder)
    rescored = _json(folder / RESULTS_FILE).get("eval_measure")
    if isinstance(rescored, dict):
        return measure_of(rescored)
    return measure_of(_json(folder / TRAINING_ARGS_FILE))


def comparable(a: dict | None, b: dict | None) -> bool:
    """Were two figures measured the same way? (Unknown measures are not.)"""
    return a is not None and b is not None and a == b


def describe(measure: dict | None, rows=None) -> str:
    """A measure for people: "187 validation rows of the sample; beams 4, length 20-64, n-gram
    blocking 3 (3 from the input), repetition penalty 1.2" ("an unknown measure" when None)."""
    if not measure:
        return "an unknown measure (no training_args.json)"
    if measure["validation_file"]:
        data = f"the validation file {measure['validation_file']}"
    elif measure["dataset_name"] == "sample":
        data = "the sample's validation split"
    else:
        data = f"{measure['dataset_name']}'s validation split"
    count = rows if isinstance(rows, int) and not isinstance(rows, bool) else measure["n_val"]
    data = f"{count:,} rows of {data}" if count else f"all of {data}"
    blocking = measure["no_repeat_ngram_size"], measure["encoder_no_repeat_ngram_size"]
    prefix = f"`{measure['source_prefix'].strip()}` + " if measure["source_prefix"].strip() else ""
    return (
        f"{data}; beams {measure['num_beams']}, length {measure['val_min_target_length']}-"
        f"{measure['val_max_target_length']}, n-gram blocking {blocking[0] or 'off'} ({blocking[1] or 'off'} from "
        f"the input), repetition penalty {measure['repetition_penalty']:g}, input {prefix}"
        f"{measure['max_source_length']} tokens"
    )
