"""``python -m finetune``: run the recipe (``finetune/train.py``) and turn whatever ends it early
into exit status 1, one ``error`` event in metrics.jsonl and one clear log line.

The app reads a run's state from metrics.jsonl (``finetune/jobs/status.py``), so every failure
that ends a run is written there once: by ``main`` here, or for a full disk during a save by the
rank it happened on (``checkpoint.saving``, which marks the error ``recorded``). ``error_event``
lists the event's fields. A rank started by a launcher stops when the launcher dies
(``parts.watch_launcher``).
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

from chat.model import ModelLoadError
from finetune import checkpoint as ckpt
from finetune.config import TrainConfig, parse_args
from finetune.data import DataError
from finetune.hub import HubError
from finetune.parts import OutputDirInUse, TrainingError, is_rank0, watch_launcher
from finetune.train import train
from finetune.writes import WriteError

# Failures the recipe expects and explains. An `error` event's kind is one of these names, or
# "internal" for anything else (a bug, or a failure nobody explained yet: see the traceback).
KNOWN_ERRORS = (DataError, ModelLoadError, TrainingError, HubError, WriteError, FileNotFoundError)


def error_event(err: Exception, cfg: TrainConfig) -> dict:
    """The fields of the ``error`` event for a failure that ended the run::

        {"event": "error", "time": ..., "kind": ..., "message": ..., "file": ...}

    ``kind``: the name of the KNOWN_ERRORS class it is, or "internal" (then ``message`` is
    "ExcType: text"). ``file``: the file or folder the error is about when the code that raised
    it knew (the bad data file, the checkpoint of a bad resume, the output dir...), else None.
    A failure inside the training loop (out of memory, non-finite loss) adds the ``step``."""
    known = next((cls for cls in KNOWN_ERRORS if isinstance(err, cls)), None)
    file = getattr(err, "file", None) or getattr(err, "filename", None)  # an OSError names its file
    if file is None and known is ModelLoadError and Path(cfg.model_name_or_path).exists():
        file = cfg.model_name_or_path  # a local model folder that would not load
    if known:
        kind, message = known.__name__, str(err)
    else:
        kind, message = "internal", f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    fields = {"kind": kind, "message": message, "file": None if file is None else str(file)}
    if getattr(err, "step", None) is not None:
        fields["step"] = err.step
    return fields


def record_error(err: Exception, cfg: TrainConfig) -> None:
    """Append the run's one ``error`` event to metrics.jsonl (the app shows the run's state from it).
    Not for an error whose ``recorded`` is set: a failed save wrote its own (``checkpoint.saving``)."""
    try:
        ckpt.MetricsWriter(cfg.output_dir, enabled=True).write("error", **error_event(err, cfg))
    except OSError as write_err:  # e.g. --output_dir is a file: the log still says what went wrong
        logging.getLogger("finetune").warning(f"could not record the error in {cfg.output_dir}: {write_err}")


def quiet_output() -> None:
    """One line per fact in the log: no deprecation warnings of torch.distributed that DeepSpeed
    and accelerate trigger (nothing a user can act on), and, when stderr is not a terminal (the
    app's train.log, CI), no progress bars: they redraw with "\\r" and escape codes. The recipe logs
    a line per logging step instead."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    if sys.stderr.isatty():
        return
    import datasets
    import huggingface_hub
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()  # (the recipe's own bars check isatty themselves)


def main(argv: list[str] | None = None) -> int:
    """``python -m finetune``: train, or exit with 1 after one ``error`` event and one clear log
    line (a traceback too for an internal error)."""
    is_main = is_rank0()
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if is_main else logging.ERROR,
        stream=sys.stderr,
    )
    watch_launcher()  # before anything slow: this process must not outlive its launcher
    quiet_output()
    logger = logging.getLogger("finetune")
    cfg = parse_args(argv)
    try:
        train(cfg)
    except OutputDirInUse as err:  # its metrics.jsonl is the earlier run's: left as it is
        if is_main:
            logger.error("%s", err)
        return 1
    except Exception as err:
        if is_main and not getattr(err, "recorded", False):  # a failed save records its own
            record_error(err, cfg)
        if not isinstance(err, KNOWN_ERRORS):  # every process logs it: the failure may be its own
            logger.exception("internal error (a bug, or a failure nobody explained yet):")
        elif is_main or getattr(err, "recorded", False):  # a failed save: maybe this rank's disk filled up
            logger.error("%s", err)
        return 1
    return 0
