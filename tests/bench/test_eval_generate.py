"""bench/eval_generate.py on the CPU: every variant runs, and fastgen and the static-cache path
write the sequences plain generate() writes (fp32; the random tiny model's ties are not broken
differently by rounding there)."""

import json

from bench.eval_generate import main


def test_eval_generate_smoke(tmp_path, capsys):
    args = ["--model", "tiny", "--batch", "3", "--new_tokens", "6", "--dtype", "float32", "--repeats", "1"]
    assert (
        main([*args, "--variants", "plain,fastgen,graphs,grouped", "--profile", "graphs", "--out", str(tmp_path)]) == 0
    )
    results = json.loads((tmp_path / "eval_generate.json").read_text())["results"]
    assert list(results) == ["plain", "fastgen", "graphs", "grouped"]
    for r in results.values():
        assert r["seconds"] > 0 and r["rows_same_as_first"] == 1.0
    profile = json.loads((tmp_path / "profile-graphs.json").read_text())
    assert profile["wall_ms_per_step"] > 0 and profile["top_cpu_ms"]
    assert "batch 3 x 10 beams, 6 tokens" in capsys.readouterr().out
