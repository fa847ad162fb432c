"""Loading, validating and tokenizing dialogue data in the MuDoConv format.

Input is either a Hub dataset (``smangrul/MuDoConv``), the shipped sample (``sample``), or local
files with ``texts``/``labels`` columns, or structured rows (``kind``, ``context``, ``turns``,
``response``) that go through ``chat.prompt.build_source``. Everything is checked before
training starts; a problem is a ``DataError`` naming the file, the row and what is wrong.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from datasets import Dataset, DatasetDict, interleave_datasets, load_dataset

from chat.layout import SAMPLE_DIR
from chat.prompt import build_source, fit_source, split_source

log = logging.getLogger(__name__)

LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
FLAT = ("texts", "labels")
STRUCTURED = ("kind", "context", "turns", "response")
# A mixed train split holds this many rows at most: a ratio far from the rows' own share repeats
# the smaller part that often (and its index takes 8 bytes a row).
MAX_MIXED_ROWS = 50_000_000


class DataError(ValueError):
    """Bad input data; the message names the file, row and problem. ``file`` is the local data
    file when there is one (not for a Hub dataset)."""

    def __init__(self, message: str, file: str | None = None):
        super().__init__(message)
        self.file = file


def _first_bad_json_line(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                return f"row {number}: not valid JSON ({err.msg})"
            if not isinstance(row, dict):
                return f"row {number}: expected a JSON object, got {type(row).__name__}"
    return ""


def _has_no_rows(file: Path, loader: str) -> bool:
    """True for a file without data rows: no non-blank line (a csv: none after its header), or
    a parquet file whose metadata counts 0 rows. Reads at most two lines / the parquet footer."""
    if loader == "parquet":
        try:
            return pq.read_metadata(file).num_rows == 0
        except Exception:
            return False  # not a parquet file at all: load_dataset reports that
    needed = 2 if loader == "csv" else 1
    with open(file, "rb") as fh:
        for line in fh:
            if line.strip():
                needed -= 1
                if not needed:
                    return False
    return True


def _read_file(path: str) -> Dataset:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{path}: no such file", file=path)
    loader = LOADERS.get(file.suffix.lower())
    if loader is None:
        raise DataError(
            f"{path}: unsupported file type {file.suffix!r} (use .jsonl, .json, .csv or .parquet)", file=path
        )
    if _has_no_rows(file, loader):  # datasets fails on these with cryptic errors (or none at all)
        raise DataError(f"{path}: the file has no rows", file=path)
    try:
        ds = load_dataset(loader, data_files=str(file), split="train")
    except Exception as err:  # datasets wraps parser errors in several exception types
        detail = _first_bad_json_line(path) if loader == "json" else ""
        cause = err.__cause__ or err
        first_line = (str(cause).splitlines() or [type(cause).__name__])[0]  # some errors have no message
        raise DataError(f"{path}: cannot read the file: {detail or first_line}", file=path) from None
    if len(ds) == 0:
        raise DataError(f"{path}: the file has no rows", file=path)
    return ds


def _check_strings(ds: Dataset, column: str, where: str) -> None:
    """Every value of ``column`` must be a non-empty string."""
    dtype = ds.features[column]
    if getattr(dtype, "dtype", None) not in ("string", "large_string"):
        for i, value in enumerate(ds[column]):
            if not isinstance(value, str):
                raise DataError(f"{where}: row {i + 1}: column {column!r} must be text, got {value!r}")
    arrow = ds.data.table.column(column)
    empty = pc.or_kleene(pc.is_null(arrow), pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(arrow)), 0))
    bad = pc.index(empty, True).as_py()
    if bad >= 0:
        raise DataError(f"{where}: row {bad + 1}: column {column!r} is empty")


def _from_structured(ds: Dataset, where: str) -> Dataset:
    texts, labels = [], []
    for i, row in enumerate(ds):
        try:
            if not isinstance(row["response"], str) or not row["response"].strip():
                raise ValueError("'response' must be non-empty text")
            turns = row["turns"]
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise ValueError("'turns' must be a list of strings")
            texts.append(build_source(row["kind"], row["context"], turns))
            labels.append(row["response"].strip())
        except ValueError as err:
            raise DataError(f"{where}: row {i + 1}: {err}") from None
    return Dataset.from_dict({"texts": texts, "labels": labels})


def validate(ds: Dataset, where: str) -> Dataset:
    """Check a split and return it with exactly the ``texts`` and ``labels`` columns."""
    if len(ds) == 0:
        raise DataError(f"{where}: the split has no rows")
    columns = set(ds.column_names)
    if set(FLAT) <= columns:
        for column in FLAT:
            _check_strings(ds, column, where)
        return ds.select_columns(list(FLAT))
    if set(STRUCTURED) <= columns:
        return _from_structured(ds, where)
    raise DataError(
        f"{where}: expected columns 'texts' and 'labels' (or {', '.join(STRUCTURED)}); "
        f"found {', '.join(sorted(columns)) or 'none'}"
    )


def load_raw(cfg) -> DatasetDict:
    """The train and validation splits, validated, cut to n_train / n_val first rows; with
    ``cfg.feedback_file`` its rows mixed into train (``mix``), with ``cfg.feedback_validation_file``
    a third split, "feedback", of held-out feedback rows."""
    local = bool(cfg.train_file or cfg.dataset_name == "sample")
    if local:
        train_file = cfg.train_file or str(SAMPLE_DIR / "train.jsonl")
        val_file = cfg.validation_file or str(SAMPLE_DIR / "validation.jsonl")
        splits = {"train": (_read_file(train_file), train_file), "validation": (_read_file(val_file), val_file)}
    else:
        try:
            hub = load_dataset(cfg.dataset_name)
        except Exception as err:
            raise DataError(
                f"cannot load dataset {cfg.dataset_name!r} from the Hub (offline, not cached, or a typo?): "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
                "Offline, use --dataset_name sample or --train_file/--validation_file."
            ) from None
        for split in ("train", "validation"):
            if split not in hub:
                raise DataError(f"dataset {cfg.dataset_name}: no {split!r} split (has {', '.join(hub)})")
        splits = {s: (hub[s], f"{cfg.dataset_name}[{s}]") for s in ("train", "validation")}

    out = {}
    for split, limit in (("train", cfg.n_train), ("validation", cfg.n_val)):
        ds, where = splits[split]
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))  # the first rows, as the seed did
        try:
            out[split] = validate(ds, where)
        except DataError as err:
            err.file = where if local else None  # a Hub split is no file
            raise
    if cfg.feedback_file:
        out["train"] = mix(out["train"], _validated_file(cfg.feedback_file), cfg.feedback_ratio, cfg.seed)
    if cfg.feedback_validation_file:
        out["feedback"] = _validated_file(cfg.feedback_validation_file)
    return DatasetDict(out)


def _validated_file(path: str) -> Dataset:
    """A local file read and validated like a train file; a DataError names it."""
    try:
        return validate(_read_file(path), path)
    except DataError as err:
        err.file = path
        raise


def mix(base: Dataset, feedback: Dataset, ratio: float, seed: int) -> Dataset:
    """Interleave ``feedback`` into ``base``: each row comes from feedback with probability
    ``ratio``, until both have been seen once ("all_exhausted": the smaller share is repeated).
    ``ratio`` 1 is the feedback rows alone. Seeded, so every process builds the same split."""
    if ratio >= 1:
        log.info(f"training on the {len(feedback)} feedback rows only (--feedback_ratio 1)")
        return feedback
    expected = max(len(base) / (1 - ratio), len(feedback) / ratio)  # draws until both are seen once
    if expected > MAX_MIXED_ROWS:
        raise DataError(
            f"--feedback_ratio {ratio} with {len(feedback)} feedback and {len(base)} train rows would make an epoch "
            f"of about {expected:,.0f} rows (more than {MAX_MIXED_ROWS:,}): choose a ratio nearer "
            f"{len(feedback) / (len(feedback) + len(base)):.3g}, the rows' own share"
        )
    if feedback.features != base.features:  # e.g. large_string from a parquet file vs string
        feedback = feedback.cast(base.features)
    mixed = interleave_datasets(
        [base, feedback], probabilities=[1 - ratio, ratio], seed=seed, stopping_strategy="all_exhausted"
    )
    log.info(f"mixed {len(feedback)} feedback rows into {len(base)} train rows (ratio {ratio}): {len(mixed)} rows")
    return mixed


def fitted_sources(texts: list[str], tokenizer, prefix: str, max_source: int) -> list[str]:
    """``prefix`` + each source, long ones fitted into ``max_source`` tokens by dropping their
    oldest turns (never the context or the newest turn), as the chat does."""

    def count(source: str) -> int:
        return len(tokenizer(prefix + source).input_ids)

    sources = [prefix + s for s in texts]
    for i, ids in enumerate(tokenizer(sources).input_ids):
        if len(ids) > max_source:
            sources[i] = prefix + fit_source(*split_source(texts[i]), count, max_source)[0]
    return sources


def tokenize(raw: DatasetDict, tokenizer, cfg) -> DatasetDict:
    """Tokenize with ``datasets.map`` (batched, cached), fitting long sources by dropping old turns."""
    prefix, max_src = cfg.source_prefix, cfg.max_source_length
    padding = "max_length" if cfg.pad_to_max_length else False

    def preprocess(batch, max_target):
        sources = fitted_sources(batch["texts"], tokenizer, prefix, max_src)
        model_inputs = tokenizer(sources, max_length=max_src, truncation=True, padding=padding)
        labels = tokenizer(text_target=batch["labels"], max_length=max_target, truncation=True, padding=padding)
        pad = tokenizer.pad_token_id
        model_inputs["labels"] = [[t if t != pad else -100 for t in seq] for seq in labels["input_ids"]]
        return model_inputs

    out = {}
    for split in raw:  # train, validation and (held-out feedback) "feedback"
        max_target = cfg.max_target_length if split == "train" else cfg.val_max_target_length
        out[split] = raw[split].map(
            preprocess,
            batched=True,
            fn_kwargs={"max_target": max_target},
            remove_columns=raw[split].column_names,
            desc=f"tokenizing {split}",
        )
    return DatasetDict(out)


class LengthGroupedSampler(torch.utils.data.Sampler):
    """A shuffled order in which each run of ``group_size`` rows has similar lengths.

    With per-batch padding, a batch costs as much as its longest row; random batches of short
    dialogues with a few long ones pay for the long ones everywhere. Each epoch: shuffle, cut
    into mega-batches of ``mega`` groups, sort each by length, cut into groups and shuffle the
    groups (a short last group stays last, so the loader's cuts line up). Mega-batches are
    small (4 groups): groups of near-equal length are also groups of near-equal kinds of
    dialogue, and on the sample data 50-group mega-batches (transformers' choice) converged
    clearly worse per step; 4 keeps most of the padding saved. The group is one
    optimizer step's rows on all processes (micro-batch x processes): the loader hands
    consecutive batches to different processes, and one process with longer rows would make
    the others wait at every gradient exchange. The order depends only on ``seed`` and the
    epoch (``set_epoch``), so a resumed run sees the same one.
    """

    def __init__(self, lengths: list[int], group_size: int, seed: int, mega: int = 4):
        self.lengths, self.group_size, self.seed, self.mega = lengths, group_size, seed, mega
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        size = self.group_size * self.mega
        order = [
            i
            for start in range(0, len(order), size)
            for i in sorted(order[start : start + size], key=lambda i: -self.lengths[i])
        ]
        groups = [order[i : i + self.group_size] for i in range(0, len(order), self.group_size)]
        last = groups.pop() if len(groups[-1]) < self.group_size else None
        groups = [groups[i] for i in torch.randperm(len(groups), generator=g).tolist()]
        if last:
            groups.append(last)
        return iter([i for group in groups for i in group])


def row_lengths(split: Dataset) -> list[int]:
    """Source + label tokens of every tokenized row (what padding a batch depends on)."""
    return [len(a) + len(b) for a, b in zip(split["input_ids"], split["labels"])]
