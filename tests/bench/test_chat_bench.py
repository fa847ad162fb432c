"""The chat benchmark's smoke mode: runs end to end on the demo model and reports every figure."""

import json

from bench.chat import main, prompt_set
from chat.engine import DEMO_DIR
from chat.prompt import KINDS


def test_prompt_set_is_multi_turn_and_typed():
    prompts = prompt_set(8)
    assert len(prompts) == 8
    assert all(conv.kind in KINDS and len(conv.turns) >= 2 and message for conv, message in prompts)
    assert len({conv.kind for conv, _ in prompts}) >= 3


def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "--model",
                str(DEMO_DIR),
                "--optimize",
                "none,int8",
                "--prompts",
                "2",
                "--repeats",
                "1",
                "--concurrency",
                "3",
                "--reply_tokens",
                "6",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert "real weights" in data["header"]
    assert [r["optimize"] for r in data["results"]] == ["none", "int8"]
    for r in data["results"]:
        assert 0 < r["fast"]["first_text_p50"] <= r["fast"]["p50"] <= r["fast"]["p95"]
        assert 0 < r["faithful"]["p50"] <= r["faithful"]["p95"]
        assert r["throughput"]["concurrent_replies_per_s"] > 0 and r["rss_gib"] > 0
    assert "| none" in capsys.readouterr().out
