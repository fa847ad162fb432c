"""Upload limits (finetune/jobs/uploads.py): a file that is small on disk but huge once read is
refused while it is read, in a confined child process, with bounded memory and no datasets cache;
every refusal names the file, the row and the limit. Normal files check exactly as training reads them."""

import json
import os
import subprocess
import sys

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hostile_files import parquet_bomb

from chat.layout import ROOT, SAMPLE_DIR
from finetune import data
from finetune.data import DataError, _read_file, validate
from finetune.jobs import upload_check, uploads
from finetune.jobs.uploads import MAX_UPLOAD_DECODED_BYTES, validate_upload

GOOD = [
    {"texts": "context: happy  <s> i got the job!", "labels": "congrats!"},
    {"texts": "hello there. </s> <s> hi! how are you?", "labels": "i am fine."},
]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Training's reader (load_dataset, the reference here) caches under tmp_path, not the home directory."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


def write(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif path.suffix == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    return path


# Run in a fresh process, so that its peak RSS (ru_maxrss) measures the checks alone; finetune.data
# (torch, datasets) is imported first, as the app has it loaded already. One line of JSON per file.
MEASURE = """
import json, logging, resource, sys, time
from finetune.data import DataError
from finetune.jobs.uploads import validate_upload

peaks = []
handler = logging.Handler()
handler.emit = lambda record: peaks.append(float(record.args[-1].split()[0]))  # the check's own VmHWM, in MB
logging.getLogger("finetune.jobs.uploads").addHandler(handler)
logging.getLogger("finetune.jobs.uploads").setLevel(logging.INFO)
for path in sys.argv[1:]:
    before, started = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    try:
        validate_upload(path, name=path.rsplit("/", 1)[-1])
        error = None
    except DataError as err:
        error = str(err)
    print(json.dumps({"error": error, "seconds": time.monotonic() - started, "checker_mb": peaks[-1],
                      "growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
"""


def measure(paths, tmp_path) -> tuple[list[dict], list[str]]:
    """Each file's check, measured in a fresh process; and the files in its datasets cache afterwards."""
    cache = tmp_path / "hf-cache-of-the-checks"
    cache.mkdir()
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, *map(str, paths)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.strip().splitlines()], [str(p) for p in cache.rglob("*")]


def test_files_huge_once_read_are_refused_quickly_with_little_memory_and_no_cache(tmp_path):
    bomb = parquet_bomb(tmp_path / "bomb.parquet")
    assert bomb.stat().st_size < 1000  # 0.9 GB of text in under a kilobyte
    rows_jsonl, rows_csv = tmp_path / "rows.jsonl", tmp_path / "rows.csv"
    rows_jsonl.write_text('{"texts": "a", "labels": "b"}\n' * 1_000_001)  # 30 MB
    rows_csv.write_text("texts,labels\n" + "a,b\n" * 1_000_001)
    line_jsonl, row_csv, cell_jsonl = tmp_path / "line.jsonl", tmp_path / "row.csv", tmp_path / "cell.jsonl"
    line_jsonl.write_text('{"texts": "' + "x" * 40_000_000 + '", "labels": "b"}\n')  # one 40 MB line
    row_csv.write_text("texts,labels\n" + "x" * 40_000_000 + ",b\n")
    cell_jsonl.write_text(json.dumps({"texts": "x" * 900_000, "labels": "b"}) + "\n")
    expected = {  # each refusal names the file, the row and the limit
        bomb: f"bomb.parquet: row {MAX_UPLOAD_DECODED_BYTES // 2000 + 1}: the rows so far hold over 512 MB of text "
        "(the limit for an upload)",  # each row holds 2 x 1000 bytes
        rows_jsonl: "rows.jsonl: row 1000001: more than 1,000,000 rows (the limit for an upload)",
        rows_csv: "rows.csv: row 1000001: more than 1,000,000 rows (the limit for an upload)",
        line_jsonl: "line.jsonl: row 1: the line is longer than 1 MB (the limit for one row)",
        row_csv: "row.csv: row 1 or after: a row is longer than 1 MB (the limit for one row)",
        cell_jsonl: "cell.jsonl: row 1: column 'texts' is 900,000 bytes; the limit is 65,536 bytes per cell",
    }
    checks, cache_files = measure(expected, tmp_path)
    for (path, error), check in zip(expected.items(), checks):
        assert check["error"] == error
        # the bomb was accepted before: +1.6 GB in the app's process, 0.9 GB of datasets cache, 6 s
        assert check["growth_mb"] < 200 and check["checker_mb"] < 200 and check["seconds"] < 60, (path, check)
    assert cache_files == []


def test_a_parquet_files_own_row_count_is_checked_before_reading(tmp_path):
    many = parquet_bomb(tmp_path / "many.parquet", rows=1_000_001, width=3)
    with pytest.raises(
        DataError,
        match=r"^many\.parquet: row 1000001: the file has 1,000,001 rows; "
        r"the limit is 1,000,000$",
    ):
        validate_upload(many, name="many.parquet")


def test_a_huge_parquet_cell_is_refused_by_the_cell_limit_or_the_memory_cap(tmp_path, monkeypatch):
    page = tmp_path / "page.parquet"  # one cell of 100 MB: a few KB compressed, in one plain-encoded page
    pq.write_table(
        pa.table({"texts": ["x" * 100_000_000], "labels": ["y"]}),
        page,
        compression="zstd",
        use_dictionary=False,
        write_statistics=False,
        data_page_size=1 << 30,
    )
    assert page.stat().st_size < 100_000
    with pytest.raises(
        DataError,
        match=r"^page\.parquet: row 1: column 'texts' is 100,000,000 bytes; "
        r"the limit is 65,536 bytes per cell$",
    ):
        validate_upload(page, name="page.parquet")
    # a file whose pages need more memory than the check may take fails inside the child, not here
    monkeypatch.setattr(uploads, "CHECK_MEMORY_BYTES", 64 * 2**20)
    with pytest.raises(DataError, match=r"^page\.parquet: row 1: reading the file needs more than 64 MB of memory"):
        validate_upload(page, name="page.parquet")


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".csv", ".parquet"])
def test_row_and_text_limits_in_every_format(ext, tmp_path, monkeypatch):
    rows = [{"texts": f"context: happy  <s> hello number {i}", "labels": f"hi {i}!"} for i in range(150)]
    path = write(tmp_path / f"data{ext}", rows)
    assert validate_upload(path)["rows"] == 150
    monkeypatch.setattr(uploads, "MAX_UPLOAD_ROWS", 100)
    # a parquet file's own row count is checked first
    refusal = "the file has 150 rows; the limit is 100" if ext == ".parquet" else "more than 100 rows"
    with pytest.raises(DataError, match=rf"^data\{ext}: row 101: {refusal}"):
        validate_upload(path, name=path.name)
    monkeypatch.setattr(uploads, "MAX_UPLOAD_ROWS", 1000)
    monkeypatch.setattr(uploads, "MAX_UPLOAD_DECODED_BYTES", 1000)
    sizes = [len(r["texts"]) + len(r["labels"]) for r in rows]
    first_over = next(n for n in range(1, len(rows)) if sum(sizes[:n]) > 1000)
    with pytest.raises(DataError, match=rf"^data\{ext}: row {first_over}: the rows so far hold over 0 MB of text"):
        validate_upload(path, name=path.name)


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".csv", ".parquet"])
def test_a_cell_over_the_limit_is_refused_in_every_format(ext, tmp_path):
    path = write(tmp_path / f"data{ext}", [*GOOD, {"texts": "a " * 35_000, "labels": "ok"}])
    with pytest.raises(
        DataError,
        match=rf"^data\{ext}: row 3: column 'texts' is 70,000 bytes; the limit is "
        "65,536 bytes per cell$",
    ):
        validate_upload(path, name=path.name)


def test_a_long_line_or_row_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    line = tmp_path / "line.jsonl"
    line.write_text(json.dumps(GOOD[0]) + "\n" + '{"texts": "' + "x" * 20_000_000)  # 20 MB, no newline
    with pytest.raises(DataError, match=r"^line\.jsonl: row 2: the line is longer than 1 MB \(the limit for one row\)"):
        validate_upload(line, name="line.jsonl")
    row = tmp_path / "row.csv"
    row.write_text("texts,labels\n" + "a,b\n" * 3 + "x" * 3_000_000 + ",b\n")
    with pytest.raises(DataError, match=r"^row\.csv: row 4 or after: a row is longer than 1 MB"):
        validate_upload(row, name="row.csv")
    array = write(tmp_path / "array.json", GOOD * 20)
    monkeypatch.setattr(uploads, "MAX_JSON_DOCUMENT_BYTES", 1000)
    with pytest.raises(DataError, match=r"^array\.json: a \.json array is parsed whole; this one is .* the limit is"):
        validate_upload(array, name="array.json")


def reference(path, prefix="chatbot: "):
    """What training reads (finetune.data, through datasets' load_dataset), as validate_upload reports it."""
    ds = validate(_read_file(str(path)), str(path))
    return {"rows": len(ds), "preview": [prefix + text for text in ds[:3]["texts"]]}


def test_normal_uploads_check_exactly_as_training_reads_them(tmp_path):
    assert (upload_check.FLAT, upload_check.STRUCTURED) == (
        data.FLAT,
        data.STRUCTURED,
    )  # copied: the check loads no torch
    sample = SAMPLE_DIR / "train.jsonl"
    expected = reference(sample)
    assert expected["rows"] == 1423
    assert validate_upload(sample) == expected  # the same preview as before the limits
    rows = [json.loads(line) for line in sample.read_text().splitlines()]
    for ext in (".json", ".csv", ".parquet"):
        assert validate_upload(write(tmp_path / f"sample{ext}", rows)) == expected, ext
    structured = write(
        tmp_path / "s.jsonl",
        [{"kind": "persona", "context": "i like tea.", "turns": ["hi", "hello"], "response": " hey! "}] * 3,
    )
    assert validate_upload(structured, source_prefix="") == reference(structured, "")
    parquet = write(tmp_path / "s.parquet", [json.loads(line) for line in structured.read_text().splitlines()])
    assert validate_upload(parquet) == reference(parquet)


BAD = {  # file -> what both training and the upload check say (csv/parquet columns have one type)
    "missing.jsonl": ([{"texts": "a b"}], "expected columns 'texts' and 'labels'", "found texts"),
    "misnamed.csv": ([{"text": "a", "label": "b"}], "expected columns 'texts' and 'labels'", "found label, text"),
    "number.jsonl": ([GOOD[0], {"texts": "a b", "labels": 3}], "row 2", "'labels' must be text"),
    "number.csv": ([{"texts": "a", "labels": 1}, {"texts": "b", "labels": 2}], "row 1", "'labels' must be text"),
    "number.parquet": ([{"texts": "a", "labels": 1}, {"texts": "b", "labels": 2}], "row 1", "'labels' must be text"),
    "null.csv": ([*GOOD, {"texts": "x", "labels": None}], "row 3", "'labels' is empty"),
    "na.csv": ([*GOOD, {"texts": "x", "labels": "NA"}], "row 3", "'labels' is empty"),  # pandas reads NA as missing
    "blank.parquet": ([GOOD[0], {"texts": "x", "labels": "   "}], "row 2", "'labels' is empty"),
    "turns.jsonl": (
        [{"kind": "persona", "context": "c", "turns": "hi", "response": "r"}],
        "row 1",
        "'turns' must be a list of strings",
    ),
    "empty.jsonl": ([], "the file has no rows"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_uploads_are_refused_as_training_refuses_them(name, tmp_path):
    rows, *needles = BAD[name]
    path = write(tmp_path / name, rows)
    for check in (reference, validate_upload):
        with pytest.raises(DataError) as refused:
            check(path)
        assert all(needle in str(refused.value) for needle in needles), (check, str(refused.value))


def test_refusals_name_the_file_as_the_user_knows_it(tmp_path):
    (tmp_path / "gradio" / "a1b2c3").mkdir(parents=True)  # where gradio keeps an upload
    path = write(tmp_path / "gradio" / "a1b2c3" / "bad.jsonl", [GOOD[0], {"texts": "x", "labels": ""}])
    with pytest.raises(DataError) as refused:
        validate_upload(path, name="my data.jsonl")
    assert str(refused.value) == "my data.jsonl: row 2: column 'labels' is empty"
    assert refused.value.file == str(path)  # the path stays available to the app, out of the message
    with pytest.raises(DataError, match="^my data.jsonl: no such file$"):
        validate_upload(tmp_path / "gone.jsonl", name="my data.jsonl")
