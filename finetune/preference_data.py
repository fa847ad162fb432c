"""Preference data: reading, validating and tokenizing the rows DPO and KTO train on.

A preference file (``--preference_file``: ``.jsonl``/``.json``/``.csv``/``.parquet``, read like
every other data file by ``finetune.data``) holds one of two row shapes, each with its source given
either as a MuDoConv ``texts`` value or as structured ``kind``, ``context``, ``turns`` (built by
``chat.prompt.build_source``, the format's one source of truth):

- DPO, pairs: ``chosen`` and ``rejected``, two replies to the same conversation;
- KTO, single replies: ``response`` and ``label`` (true: a good reply, false: a bad one).

A problem is a ``DataError`` naming the file, the row and what is wrong, before training starts.
"""

from __future__ import annotations

from datasets import Dataset

from chat.prompt import build_source
from finetune.data import DataError, _read_file, fitted_sources

SHAPES = {"dpo": ("chosen", "rejected"), "kto": ("response", "label")}
SOURCE_COLUMNS = (("texts",), ("kind", "context", "turns"))
HOLDOUT_EVERY = 10  # without --preference_validation_file, every 10th row is held out
_TRUE, _FALSE = ("true", "1", "yes", "good", "desirable"), ("false", "0", "no", "bad", "undesirable")


def shape_of(columns: set[str]) -> str | None:
    """The objective whose row shape ``columns`` hold (None: neither)."""
    return next((objective for objective, cols in SHAPES.items() if set(cols) <= columns), None)


def _label(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"'label' must be true or false, got {value!r}")


def _reply(row: dict, column: str) -> str:
    value = row[column]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{column!r} must be non-empty text")
    return value.strip()


def _source(row: dict) -> str:
    """A row's source: its ``texts``, else built from ``kind``, ``context`` and ``turns`` (a file
    may mix the two forms; the missing columns of a row read as None)."""
    if row.get("texts") is not None:
        value = row["texts"]
        if not isinstance(value, str) or not value.strip():
            raise ValueError("'texts' must be non-empty text")
        return value
    if row.get("turns") is None and row.get("kind") is None:
        raise ValueError("no source: give 'texts', or 'kind', 'context' and 'turns'")
    turns = row["turns"]
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise ValueError("'turns' must be a list of strings")
    return build_source(row["kind"], row["context"], turns)


def validate(ds: Dataset, where: str, objective: str) -> Dataset:
    """Check preference rows for ``objective`` ("dpo" or "kto"); returns ``texts`` plus
    ``chosen``/``rejected`` or ``response``/``label`` (a bool)."""
    columns = set(ds.column_names)
    found = shape_of(columns)
    if found is None:
        raise DataError(
            f"{where}: expected preference rows: 'chosen' and 'rejected' (DPO) or 'response' and 'label' (KTO), "
            f"with 'texts' or 'kind', 'context', 'turns'; found {', '.join(sorted(columns)) or 'none'}",
            file=where,
        )
    if found != objective:
        raise DataError(
            f"{where}: the rows are {found.upper()} rows ({', '.join(SHAPES[found])}): use --objective {found}",
            file=where,
        )
    if not any(set(form) <= columns for form in SOURCE_COLUMNS):
        raise DataError(f"{where}: each row needs its source: 'texts', or 'kind', 'context' and 'turns'", file=where)
    first, second = SHAPES[objective]
    out = {"texts": [], first: [], second: []}
    for i, row in enumerate(ds):
        try:
            out["texts"].append(_source(row))
            out[first].append(_reply(row, first))
            if objective == "dpo":
                out[second].append(_reply(row, second))
                if out[first][-1] == out[second][-1]:
                    raise ValueError("'chosen' and 'rejected' are the same reply (nothing to prefer)")
            else:
                out[second].append(_label(row[second]))
        except ValueError as err:
            raise DataError(f"{where}: row {i + 1}: {err}", file=where) from None
    if not out["texts"]:
        raise DataError(f"{where}: the file has no rows", file=where)
    return Dataset.from_dict(out)


def load_preferences(path: str, objective: str, validation_path: str | None = None) -> tuple[Dataset, Dataset]:
    """(train, held-out) preference rows: the held-out ones from ``validation_path``, else every
    ``HOLDOUT_EVERY``-th row of ``path`` (so a file of fewer rows holds none out)."""
    rows = validate(_read_file(path), path, objective)
    if validation_path:
        return rows, validate(_read_file(validation_path), validation_path, objective)
    held = [i for i in range(len(rows)) if (i + 1) % HOLDOUT_EVERY == 0]
    kept = [i for i in range(len(rows)) if (i + 1) % HOLDOUT_EVERY != 0]
    return rows.select(kept), rows.select(held)


def tokenize(rows: Dataset, tokenizer, cfg, objective: str) -> Dataset:
    """Token ids for each row: ``input_ids`` (prefix + source, oldest turns dropped to fit) and
    one label column per reply (``chosen_labels``/``rejected_labels`` or ``labels``), cut to
    ``max_target_length``; KTO rows keep their ``label``."""

    def encode(batch):
        sources = fitted_sources(batch["texts"], tokenizer, cfg.source_prefix, cfg.max_source_length)
        out = {"input_ids": tokenizer(sources, max_length=cfg.max_source_length, truncation=True).input_ids}
        replies = (
            (("chosen", "chosen_labels"), ("rejected", "rejected_labels"))
            if objective == "dpo"
            else (("response", "labels"),)
        )
        for column, name in replies:
            out[name] = tokenizer(
                text_target=batch[column], max_length=cfg.max_target_length, truncation=True
            ).input_ids
        return out

    keep = ["label"] if objective == "kto" else []
    drop = [c for c in rows.column_names if c not in keep]
    out = rows.map(encode, batched=True, remove_columns=drop, desc=f"tokenizing {objective} rows")
    if objective == "kto":  # KTO's KL estimate: each source with the next row's reply (none for one row)
        replies = out["labels"]
        others = [replies[(i + 1) % len(replies)] for i in range(len(replies))] if len(replies) > 1 else [[-100]]
        out = out.add_column("kl_labels", others)
    return out
