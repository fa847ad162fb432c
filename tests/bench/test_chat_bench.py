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
                "none:capture,int8",
                "--plain",
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
    assert data["results"][0]["graphs"] == "capture"  # asked for; on a CPU it changes nothing
    plain = data["results"][0]["plain_faithful"]
    assert 0 < plain["p50"] <= plain["p95"] and len(plain["replies"]) == 2
    # The engine (fastgen, batcher) writes the replies plain generate() writes, on the same model.
    assert data["results"][0]["faithful"]["replies"] == plain["replies"]
    assert data["results"][0]["fast"]["replies"] == data["results"][0]["plain_fast"]["replies"]
    for r in data["results"]:
        assert 0 < r["fast"]["first_text_p50"] <= r["fast"]["p50"] <= r["fast"]["p95"]
        assert 0 < r["faithful"]["p50"] <= r["faithful"]["p95"]
        assert r["fast"]["new_shape_p50"] > 0 and r["faithful"]["new_shape_p50"] > 0
        assert r["throughput"]["concurrent_replies_per_s"] > 0 and r["rss_gib"] > 0
    printed = capsys.readouterr().out
    assert "| plain generate, none" in printed and "| none, graphs capture" in printed and "2/2, 2/2" in printed


def test_fresh_prompts_give_every_reply_a_source_length_not_served_before():
    from bench.chat import fresh_prompts, source_length
    from chat.engine import ChatEngine, load_apart

    engine = ChatEngine(load_apart(str(DEMO_DIR)), "test")
    prompts = prompt_set(4)

    taken = {source_length(engine, c, m) for c, m in prompts}
    served = set(taken)
    fresh = fresh_prompts(engine, prompts, taken)
    assert len(fresh) == len(prompts)
    lengths = [source_length(engine, c, m) for c, m in fresh]
    assert len(set(lengths)) == len(lengths) and not set(lengths) & served
    assert all(m.startswith(orig) and c is conv for (c, m), (conv, orig) in zip(fresh, prompts))


def test_unknown_graph_mode_is_refused():
    import pytest

    from chat.batching import graph_mode

    assert graph_mode("1") == "capture" and graph_mode(" OFF ") == "off" and graph_mode("compile") == "compile"
    with pytest.raises(ValueError, match="CHAT_CUDA_GRAPHS"):
        graph_mode("yes")


def test_adapter_mode_times_base_and_adapter_in_one_run(tmp_path, capsys):
    out = tmp_path / "adapter.json"
    argv = ["--model", str(DEMO_DIR), "--adapter", "--adapter_r", "4", "--optimize", "int8", "--prompts", "2"]
    assert main([*argv, "--repeats", "1", "--reply_tokens", "5", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "LoRA r4 on q_proj" in data["header"] and data["command"].startswith("python -m bench.chat --model")
    (result,) = data["results"]
    assert result["optimize"] == "int8" and 0 < result["attach_seconds"] and result["adapter_mb"] > 0
    for preset in ("fast", "faithful"):
        figures = result[preset]
        for side in ("base", "adapter", "base_beside_adapters"):
            assert 0 < figures[side]["p50"] <= figures[side]["p95"]
        assert figures["adapter_overhead_p50"] == figures["adapter"]["p50"] / figures["base"]["p50"] - 1
        assert -1 < figures["adapter_overhead_paired_median"] and figures["adapter"]["cpu_p50"] > 0
    assert result["fast"]["adapter"]["first_text_p50"] > 0 and result["faithful"]["adapter"]["first_text_p50"] is None
    assert (
        result["lora_forward"] == "lean"
        and "| int8, graphs capture (cpu), LoRA forward: lean |" in capsys.readouterr().out
    )
