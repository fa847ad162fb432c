"""The confined child process that checks an upload (``finetune/jobs/uploads.py`` starts it).

It reads one request (JSON) on stdin, imports what reading needs, caps its own address space and
CPU time, then streams the file (parquet row batches, csv blocks, json line by line), stops at the
first row over a limit, and answers one JSON line on stdout: the rows and a preview, the split's
row counts, or the refusal. It never imports datasets or torch, so nothing lands in their caches.
"""

from __future__ import annotations

import codecs
import itertools
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from finetune.writes import WriteError, writing

log = logging.getLogger(__name__)

FLAT = ("texts", "labels")
STRUCTURED = ("kind", "context", "turns", "response")
# Cells pandas (so datasets, so training) reads from a csv file as missing: they are empty rows there too.
CSV_NULLS = [
    "",
    "#N/A",
    "#N/A N/A",
    "#NA",
    "-1.#IND",
    "-1.#QNAN",
    "-NaN",
    "-nan",
    "1.#IND",
    "1.#QNAN",
    "<NA>",
    "N/A",
    "NA",
    "NULL",
    "NaN",
    "None",
    "n/a",
    "nan",
    "null",
]
# A csv column whose every value matches is numbers (or booleans) to pandas, not text.
CSV_NUMBER = (
    r"^\s*([-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|Inf|INF|infinity|Infinity)"
    r"|True|TRUE|true|False|FALSE|false)\s*$"
)
_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
PARQUET_BATCH_ROWS = 256  # at most 256 x 2 x 64 KB of text decoded at a time


def megabytes(n: int) -> str:
    """``n`` bytes as "12.5 MB" (whole numbers without ".0"), for limits named in messages."""
    return f"{n / 2**20:.1f}".removesuffix(".0") + " MB"


class _Rejected(Exception):
    """A refusal, without the file's name (added by _check_main)."""


def _status_bytes(key: str) -> int | None:
    """A size from /proc/self/status (Linux only), in bytes."""
    try:
        return int(Path("/proc/self/status").read_text().split(f"{key}:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None


def _confine(limits: dict) -> None:
    """Import what reading needs, then cap this process's address space (Linux) and CPU time."""
    import resource

    import pyarrow as pa
    import pyarrow.csv  # imported before the cap: the libraries' own size is not the file's
    import pyarrow.parquet

    import chat.prompt  # noqa: F401

    pa.set_cpu_count(1)  # the CPU is shared with the chat
    pa.set_io_thread_count(1)
    size = _status_bytes("VmSize")
    caps = [(resource.RLIMIT_CPU, limits["seconds"])]
    caps += [(resource.RLIMIT_AS, size + limits["memory_bytes"])] if size else []
    for kind, soft in caps:
        hard = resource.getrlimit(kind)[1]
        resource.setrlimit(kind, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def main() -> None:
    """The child: read a request on stdin, answer one JSON line on stdout."""
    request = json.loads(sys.stdin.read())
    limits, name = request["limits"], request["name"]
    progress = [0]  # rows accepted so far, for a refusal that comes from the reader
    try:
        _confine(limits)
        answer = (_check if request["mode"] == "check" else _split)(request, progress)
    except _Rejected as err:
        answer = {"error": f"{name}: {err}"}
    except WriteError as err:  # the split's own files: the upload itself is fine
        for tmp in Path(request.get("outputs", ["."])[0]).parent.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        answer = {"error": str(err)}
    except MemoryError:
        answer = {
            "error": f"{name}: row {progress[0] + 1}: reading the file needs more than "
            f"{megabytes(limits['memory_bytes'])} of memory (the limit for checking an upload)"
        }
    except Exception as err:  # noqa: BLE001 - a parser's own error: the file is not what its name says
        cause = (str(err).splitlines() or [type(err).__name__])[0]
        after = f" after row {progress[0]}" if progress[0] else ""
        answer = {"error": f"{name}: cannot read the file{after}: {cause}"}
    answer["peak_bytes"] = _status_bytes("VmHWM")  # for the log: what the check really took
    sys.stdout.write(json.dumps(answer) + "\n")


def _check(request: dict, progress: list) -> dict:
    preview = []
    for texts, _ in _validated(request["path"], request["limits"], progress):
        if len(preview) < 3:
            preview.append(texts)
    return {"rows": progress[0], "preview": preview}


def _split(request: dict, progress: list) -> dict:
    path, limits = request["path"], request["limits"]
    n = sum(1 for _ in _validated(path, limits, progress))  # first pass: every row checked, counted
    if n < 2:
        raise _Rejected(f"{n} row; at least 2 are needed to hold out a validation split (or upload a validation file)")
    n_val = max(1, int(n * request["fraction"]))
    outputs = [Path(p) for p in request["outputs"]]
    tmps = [p.with_name(f".{p.name}.tmp") for p in outputs]  # renamed into place: resume never sees half a file
    with writing(outputs[0].parent):  # a failed write names the file and the cause (a WriteError)
        with open(tmps[0], "w", encoding="utf-8") as train, open(tmps[1], "w", encoding="utf-8") as val:
            for i, (texts, labels) in enumerate(_validated(path, limits, [0])):
                out = train if i < n - n_val else val
                out.write(json.dumps({"texts": texts, "labels": labels}, ensure_ascii=False) + "\n")
        for tmp, out in zip(tmps, outputs):
            os.replace(tmp, out)
    return {"train": n - n_val, "validation": n_val}


def _validated(path: str, limits: dict, progress: list) -> Iterator[tuple[str, str]]:
    """(texts, labels) of every row, checked as finetune.data.validate checks them and against the limits."""
    suffix = Path(path).suffix.lower()
    reader = {".jsonl": _json_rows, ".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}.get(suffix)
    if reader is None:
        raise _Rejected(f"unsupported file type {suffix!r} (use .jsonl, .json, .csv or .parquet)")
    columns, rows = reader(path, limits)
    if not columns:
        raise _Rejected("the file has no rows")
    convert = _flat if set(FLAT) <= columns else _structured if set(STRUCTURED) <= columns else None
    if convert is None:
        raise _Rejected(
            f"expected columns 'texts' and 'labels' (or {', '.join(STRUCTURED)}); "
            f"found {', '.join(sorted(columns)) or 'none'}"
        )
    total = 0
    for n, row in enumerate(rows, 1):
        if n > limits["rows"]:
            raise _Rejected(f"row {n}: more than {limits['rows']:,} rows (the limit for an upload)")
        texts, labels = convert(row, n)
        for column, value in (("texts", texts), ("labels", labels)):
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError:  # a lone surrogate from a JSON \ud800 escape
                raise _Rejected(f"row {n}: column {column!r} is not valid UTF-8 text") from None
            if size > limits["cell_bytes"]:
                raise _too_big(n, column, size, limits)
            total += size
        if total > limits["text_bytes"]:
            raise _Rejected(
                f"row {n}: the rows so far hold over {megabytes(limits['text_bytes'])} of text "
                "(the limit for an upload)"
            )
        progress[0] = n
        yield texts, labels
    if not progress[0]:
        raise _Rejected("the file has no rows")


def _too_big(n: int, column: str, size: int, limits: dict) -> _Rejected:
    return _Rejected(
        f"row {n}: column {column!r} is {size:,} bytes; the limit is {limits['cell_bytes']:,} bytes per cell"
    )


def _flat(row: dict, n: int) -> tuple[str, str]:
    out = []
    for column in FLAT:
        value = row.get(column)
        if value is not None and not isinstance(value, str):
            raise _Rejected(f"row {n}: column {column!r} must be text, got {repr(value)[:60]}")
        if value is None or not value.strip():
            raise _Rejected(f"row {n}: column {column!r} is empty")
        out.append(value)
    return out[0], out[1]


def _structured(row: dict, n: int) -> tuple[str, str]:
    """finetune.data._from_structured for one row."""
    from chat.prompt import build_source

    try:
        response, turns = row.get("response"), row.get("turns")
        if not isinstance(response, str) or not response.strip():
            raise ValueError("'response' must be non-empty text")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a list of strings")
        return build_source(row.get("kind"), row.get("context"), turns), response.strip()
    except (ValueError, TypeError, AttributeError) as err:
        raise _Rejected(f"row {n}: {err}") from None


def _json_rows(path: str, limits: dict) -> tuple[set, Iterator[dict]]:
    """As datasets reads json: JSON lines, unless the file starts with '[' (one array of rows)."""
    with open(path, "rb") as fh:
        array = fh.read(1 << 16).removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"[")
    rows = _json_array(path, limits) if array else _json_lines(path, limits)
    first = next(rows, None)
    return (set(), iter(())) if first is None else (set(first), itertools.chain([first], rows))


def _json_lines(path: str, limits: dict) -> Iterator[dict]:
    row = line_no = 0
    with open(path, "rb") as fh:
        while line := fh.readline(limits["line_bytes"] + 2):
            line_no += 1
            if not line.strip():
                continue
            row += 1
            where = f"row {row}" + (f" (line {line_no})" if line_no != row else "")
            if len(line.rstrip(b"\r\n")) > limits["line_bytes"]:
                raise _Rejected(
                    f"{where}: the line is longer than {megabytes(limits['line_bytes'])} (the limit for one row)"
                )
            try:
                value = json.loads(line)
            except ValueError as err:  # JSONDecodeError, or bytes that are no UTF-8
                raise _Rejected(f"{where}: not valid JSON ({getattr(err, 'msg', None) or err})") from None
            if not isinstance(value, dict):
                raise _Rejected(f"{where}: expected a JSON object, got {type(value).__name__}")
            yield value


def _json_array(path: str, limits: dict) -> Iterator[dict]:
    """One JSON array, parsed whole but decoded one item at a time."""
    size = os.path.getsize(path)
    if size > limits["document_bytes"]:
        raise _Rejected(
            f"a .json array is parsed whole; this one is {megabytes(size)}, the limit is "
            f"{megabytes(limits['document_bytes'])} (JSON lines, one object per line, may be larger)"
        )
    text = Path(path).read_bytes().decode("utf-8-sig")
    decoder, pos, row = json.JSONDecoder(), _WS.match(text, _WS.match(text).end() + 1).end(), 0  # past '['
    while not (row == 0 and text.startswith("]", pos)):
        row += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError as err:
            raise _Rejected(f"row {row}: not valid JSON ({getattr(err, 'msg', None) or err})") from None
        if isinstance(value, str):
            value = {"text": value}  # datasets reads a list of strings as one "text" column
        if not isinstance(value, dict):
            raise _Rejected(f"row {row}: expected a JSON object, got {type(value).__name__}")
        yield value
        pos = _WS.match(text, pos).end()
        if text.startswith("]", pos):
            break
        if not text.startswith(",", pos):
            raise _Rejected(f"row {row}: not valid JSON (expected ',' or ']' at character {pos})")
        pos = _WS.match(text, pos + 1).end()
    if text[pos + 1 :].strip():
        raise _Rejected(f"not valid JSON (extra data after the array, at character {pos + 1})")


def _csv_rows(path: str, limits: dict) -> tuple[set, Iterator[dict]]:
    """Streamed in blocks by pyarrow; every cell read as text, pandas' missing values as missing."""
    import csv

    import pyarrow as pa
    import pyarrow.csv as pacsv

    with open(path, encoding="utf-8-sig", newline="") as fh:
        header = next(csv.reader(fh), None)  # csv's field size limit (128 KB) bounds a bad header
    needed = [c for c in (*FLAT, *STRUCTURED) if c in (header or ())]
    if not needed:  # no header (no rows), or not the columns training needs
        return set(header or ()), iter(())
    options = {
        "read_options": pacsv.ReadOptions(block_size=limits["line_bytes"], use_threads=False),
        "parse_options": pacsv.ParseOptions(newlines_in_values=True),
        "convert_options": pacsv.ConvertOptions(
            column_types=dict.fromkeys(needed, pa.string()),
            include_columns=needed,
            strings_can_be_null=True,
            null_values=CSV_NULLS,
        ),
    }
    texts = [c for c in needed if c in (*FLAT, "response")]
    return set(header), _arrow_rows(lambda: _not_numbers(pacsv.open_csv(path, **options), texts), limits)


def _not_numbers(batches: Iterable, columns: list[str]) -> Iterator:
    """The batches; at the end, refuse a text column whose every value is a number, as pandas
    (so training) would read it as numbers, not text."""
    import pyarrow.compute as pc

    numeric = dict.fromkeys(columns, True)
    for batch in batches:
        for column in columns:
            numeric[column] = (
                numeric[column]
                and pc.all(pc.match_substring_regex(batch.column(column), CSV_NUMBER), skip_nulls=True).as_py()
                is not False
            )
        yield batch
    for column in columns:
        if numeric[column]:
            raise _Rejected(
                f"row 1: column {column!r} must be text, got numbers (every value of the column is a "
                "number, so training reads it as numbers)"
            )


def _parquet_rows(path: str, limits: dict) -> tuple[set, Iterator[dict]]:
    """Row batches of the needed columns only; the footer's row count is checked before any is read."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path, buffer_size=1 << 20)  # column chunks read 1 MB at a time, not whole
    claimed = file.metadata.num_rows
    if claimed > limits["rows"]:
        raise _Rejected(f"row {limits['rows'] + 1}: the file has {claimed:,} rows; the limit is {limits['rows']:,}")
    names = set(file.schema_arrow.names)
    needed = list(FLAT) if set(FLAT) <= names else [c for c in STRUCTURED if c in names]
    return names, _arrow_rows(
        lambda: file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=needed, use_threads=False), limits
    )


def _arrow_rows(open_batches: Callable[[], Iterable], limits: dict) -> Iterator[dict]:
    """The rows of pyarrow record batches; a text cell over the limit is refused before it becomes a str."""
    import pyarrow as pa
    import pyarrow.compute as pc

    done = 0
    try:
        for batch in open_batches():  # opening a csv file reads its first block
            for column, values in zip(batch.schema.names, batch.columns):
                if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
                    sizes = pc.binary_length(values)
                    over = pc.index(pc.greater(sizes, limits["cell_bytes"]), True).as_py()
                    if over >= 0:
                        raise _too_big(done + over + 1, column, sizes[over].as_py(), limits)
            for start in range(0, batch.num_rows, 1024):  # a csv block may hold 250,000 tiny rows
                yield from batch.slice(start, 1024).to_pylist()
            done += batch.num_rows
    except pa.ArrowInvalid as err:
        if "straddl" in str(err):  # a csv row longer than a block
            raise _Rejected(
                f"row {done + 1} or after: a row is longer than {megabytes(limits['line_bytes'])} "
                "(the limit for one row)"
            ) from None
        raise
