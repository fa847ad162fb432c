"""Files an attacker would upload, built on the fly for the upload-limit tests."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def parquet_bomb(path: Path, rows: int = 450_000, width: int = 1000) -> Path:
    """A parquet file of a few hundred bytes: every row repeats one dictionary value of ``width``
    characters in both columns, so it decodes to rows x width x 2 bytes of text (0.9 GB)."""
    value = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array(["x" * width]))
    pq.write_table(
        pa.table({"texts": value, "labels": value}),
        path,
        compression="zstd",
        compression_level=22,
        write_statistics=False,
        store_schema=False,
        data_page_size=1 << 30,
        write_page_index=False,
        max_rows_per_page=1 << 20,
    )
    return path
