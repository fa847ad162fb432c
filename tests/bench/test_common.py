"""bench/common.py: the one percentile every benchmark reports, and the shared helpers."""

import json
import statistics
import time

import pytest

from bench import chat as chat_bench
from bench import cpu_variants
from bench.common import command_line, md_table, percentile, versions, write_json


def test_percentile_interpolates_linearly_on_a_0_to_100_scale():
    assert percentile([3.0], 95) == 3.0
    assert percentile([4, 1, 3, 2], 50) == 2.5 == statistics.median([4, 1, 3, 2])
    eight = [float(x) for x in range(1, 9)]  # 8 prompts x 1 repeat, as in docs/chat-benchmarks.md
    assert percentile(eight, 95) == pytest.approx(7.65)  # 65 % of the way from the 7th to the 8th
    assert percentile(eight, 0) == 1 and percentile(eight, 100) == 8
    sixteen = [float(x) for x in range(16)]
    assert percentile(sixteen, 95) == pytest.approx(14.25)


def test_percentile_refuses_no_values_and_fractions_of_one_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0, 2.0], 101)


def test_both_chat_benchmarks_use_the_shared_percentile():
    assert chat_bench.percentile is percentile and cpu_variants.percentile is percentile


def test_md_table_aligns_and_writes_one_line_per_row():
    assert md_table(["run", "rate"], [["a", 1], ["b", 2.5]], align="lr") == [
        "| run | rate |",
        "| --- | ---: |",
        "| a | 1 |",
        "| b | 2.5 |",
    ]


def test_versions_and_command_line_record_the_run(tmp_path):
    env = versions("accelerate")
    assert {"date", "python", "torch", "transformers", "accelerate"} <= set(env)
    assert command_line("bench.chat", ["--prompts", "2"]) == "python -m bench.chat --prompts 2"
    path = write_json(tmp_path / "deep" / "r.json", {"env": env})
    assert json.loads(path.read_text()) == {"env": env}


def test_cpu_seconds_reads_another_process_as_this_one_counts_itself():
    import subprocess
    import sys

    from bench.common import cpu_seconds

    # A child that burns about 0.6 s of CPU, then waits to be read.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time, sys\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
         "print(time.process_time(), flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        own = float(child.stdout.readline())
        seen = cpu_seconds(child.pid)
        assert own - 0.05 <= seen <= own + 0.2  # /proc counts in clock ticks (1/100 s)
    finally:
        child.communicate("")
    assert cpu_seconds(child.pid) == 0.0  # gone: nothing to read
    assert cpu_seconds() == pytest.approx(time.process_time(), abs=0.05)


def test_cpu_seconds_of_a_process_and_its_children(tmp_path):
    import subprocess
    import sys

    from bench.common import cpu_seconds

    # A parent that waits while its child burns about 0.6 s of CPU and then waits to be read.
    child = tmp_path / "burn.py"
    child.write_text("import time, sys\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
                     "print(1, flush=True)\nsys.stdin.read()\n")  # fmt: skip
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, {str(child)!r}])"
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        parent.stdout.readline()
        alone, tree = cpu_seconds(parent.pid), cpu_seconds(parent.pid, descendants=True)
        assert alone < 0.3 and tree - alone >= 0.55
    finally:
        parent.communicate("")
    assert cpu_seconds(parent.pid, descendants=True) == 0.0
