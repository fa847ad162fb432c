"""bench.api end to end, small: it starts python app.py (offline: the demo model) and times the
same streamed replies through /chat and /v1/chat/completions."""

import json

from bench.api import main


def test_api_bench_smoke(tmp_path, capsys):
    out = tmp_path / "api.json"
    argv = ["--prompts", "2", "--repeats", "2", "--warmup", "1", "--max_tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "/v1/chat/completions" in printed and "/chat (gradio_client" in printed
    result = json.loads(out.read_text())["result"]
    for name in ("chat", "api"):
        assert len(result[name]["seconds"]) == 4 and result[name]["p50"] > 0 and result[name]["first_text_p50"] > 0
        assert len(result[name]["app_cpu_seconds"]) == 4 and result[name]["app_cpu_p50"] > 0
    assert result["model"] == "demo-model" and result["same_replies"] == 4  # greedy: the same replies
    assert result["paired_ratio_p50"] > 0 and "paired ratios" in printed
