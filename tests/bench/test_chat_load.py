"""bench.chat_load, bench.chat_serve, bench.gil_wait and bench.join_stage end to end, small, on the
demo model: the schedulers (and LoRA adapters spread over the chats) in one run; the engine alone
against the running app; a torch call beside busy threads; a join's staging against its baseline."""

import json

import pytest

from bench import chat_load, chat_serve, gil_wait, join_stage
from chat.engine import DEMO_DIR


def test_load_smoke_both_schedulers_with_adapters(tmp_path, capsys):
    out = tmp_path / "load.json"
    argv = ["--model", str(DEMO_DIR), "--concurrency", "1,3", "--replies", "3", "--reply_tokens", "6"]
    assert chat_load.main([*argv, "--adapters", "2", "--adapter_r", "4", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["scheduler"], r["clients"]) for r in results] == [("static", 1), ("step", 1), ("static", 3), ("step", 3)]
    for r in results:
        assert r["replies_per_s"] > 0 and 0 < r["first_text_p50"] <= r["p50"] <= r["p95"] and len(r["texts"]) == 3
    # Greedy replies on the trained demo model: the same whichever scheduler serves them.
    assert results[3]["texts"] == results[2]["texts"] and results[1]["texts"] == results[0]["texts"]
    assert "2 LoRA adapters" in capsys.readouterr().out


def test_serve_smoke_engine_and_app(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["--concurrency", "3", "--replies", "4", "--max_tokens", "6", "--prompts", "3", "--out", str(out)]
    assert chat_serve.main([*argv, "--clients_per_process", "1"]) == 0
    results = json.loads(out.read_text())["results"]
    # gradio_client last: its clients' threads, even closed, are the heaviest in a process.
    paths = ["engine alone", "/chat (HTTP, httpx)", "/v1 (openai)", "/chat (gradio_client)"]
    assert [r["path"] for r in results] == paths
    # The same replies in the same order, though through the server each client ran in a process of its
    # own (replies 0, 1 and 2-3 in three: prompts 0, 1, 2, 0 as in one process), and none failed.
    assert all(r["texts"] == results[0]["texts"] and all(r["texts"]) and not r["errors"] for r in results)
    assert len(set(results[0]["texts"][:3])) == 3  # three prompts, three replies: an order that can be wrong
    assert [r["client_processes"] for r in results] == [0, 3, 3, 3]
    assert all(r["replies_per_s"] > 0 and r["clients"] == 3 and r["p50"] > 0 for r in results)
    assert all(len(r["first_texts"]) == 4 and 0 < min(r["first_texts"]) for r in results)
    # The app's process works for the replies through it, not for the engine alone's; the client
    # processes' CPU is counted for the replies through the server.
    cpu = {r["path"]: (r["app_cpu_per_reply"], r["bench_cpu_per_reply"]) for r in results}
    assert cpu["/v1 (openai)"][0] > 0 and cpu["/chat (gradio_client)"][0] > 0 and cpu["engine alone"][1] > 0
    assert cpu["engine alone"][0] < cpu["/v1 (openai)"][0] and cpu["/v1 (openai)"][1] > 0
    assert "engine alone" in capsys.readouterr().out


def test_a_round_merged_from_its_client_processes():
    from bench.serve_clients import merged

    parts = [
        {"texts": ["a", None], "latencies": [1.0, None], "first_texts": [0.5, None], "errors": ["x"],
         "started": 10.0, "ended": 12.0, "cpu": 0.3},
        {"texts": ["b", "c"], "latencies": [2.0, 3.0], "first_texts": [0.25, 1.0], "errors": [],
         "started": 10.5, "ended": 14.0, "cpu": 0.5},
    ]  # fmt: skip
    r = merged(parts, clients=4)
    assert r["replies"] == 4 and r["replies_per_s"] == 1.0  # 4 replies from t=10 to t=14
    assert r["texts"] == ["a", None, "b", "c"] and r["errors"] == ["x"]
    assert r["p50"] == 2.0 and r["p95"] == 2.9 and r["first_text_p50"] == 0.5  # the failed reply left out
    assert r["client_processes"] == 2 and r["bench_cpu_per_reply"] == 0.2


def test_a_rounds_clients_and_replies_split_over_its_processes_each_client_its_own_address():
    from bench.serve_clients import address, plan

    assert plan(3, 4, 1) == [(0, 1, 0, 1), (1, 1, 1, 1), (2, 1, 2, 2)]
    assert plan(2, 16, 8) == [(0, 2, 0, 16)]
    shares = plan(64, 500, 8)
    assert [c for _, c, _, _ in shares] == [8] * 8 and sum(r for *_, r in shares) == 500
    # Every client and every reply in exactly one process, in order.
    assert [first for first, *_ in shares] == list(range(0, 64, 8))
    assert all(a[2] + a[3] == b[2] for a, b in zip(shares, shares[1:]))
    assert len({address(k) for k in range(1000)}) == 1000


def test_the_serve_benchmark_refuses_an_app_pid_it_cannot_read(capsys):
    with pytest.raises(SystemExit):
        chat_serve.main(["--app_pid", "1"])  # without --url: the app it starts is read anyway
    assert "--app_pid is for an app started apart (--url)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chat_serve.main(["--url", "http://127.0.0.1:9/", "--app_pid", str(2**22 + 1)])  # above Linux's pid_max
    assert "no such process" in capsys.readouterr().err


def test_a_failing_client_process_fails_the_round_with_its_error():
    from bench.serve_clients import server_round
    from chat.engine import Conversation

    chats = [(Conversation(), "hi")]
    with pytest.raises(RuntimeError, match=r"2 of 2 client processes failed(.|\n)*ConnectError"):
        server_round("http://127.0.0.1:9/", "/v1 (openai)", "fast", 4, chats, 2, 2, 1)  # nothing listens there


def test_load_smoke_serial_steps_and_a_stream_interval(tmp_path, capsys):
    out = tmp_path / "load.json"
    argv = ["--model", str(DEMO_DIR), "--schedulers", "step-serial,step", "--concurrency", "2", "--replies", "2"]
    assert chat_load.main([*argv, "--reply_tokens", "5", "--stream_interval", "0.05", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["scheduler"] for r in data["results"]] == ["step-serial", "step"]
    assert data["results"][0]["texts"] == data["results"][1]["texts"] and "every 0.05 s" in data["header"]
    with pytest.raises(SystemExit):  # argparse's error: a negative interval is no interval
        chat_load.main([*argv, "--stream_interval", "-1"])
    assert "--stream_interval must be 0 (every token) or more seconds" in capsys.readouterr().err


def test_gil_wait_smoke(tmp_path):
    out = tmp_path / "gil.json"
    assert gil_wait.main(["--threads", "0,2", "--calls", "50", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["threads"] for r in results] == [0, 2]
    assert all(r["torch_op_us"] > 0 and r["python_us"] > 0 for r in results)


def test_load_smoke_beam_search_beside_greedy_chats_in_and_out_of_the_steps(tmp_path):
    out = tmp_path / "load.json"
    argv = ["--model", str(DEMO_DIR), "--schedulers", "step,step-beams", "--concurrency", "3", "--replies", "4"]
    argv += ["--reply_tokens", "6", "--max_batch", "20", "--faithful_every", "2", "--prompts", "4"]
    assert chat_load.main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["scheduler"] for r in data["results"]] == ["step", "step-beams"]
    assert data["results"][0]["texts"] == data["results"][1]["texts"] and all(data["results"][0]["texts"])
    assert "1 in 2 chats faithful" in data["header"] and all(r["other_p50"] > 0 for r in data["results"])


def test_load_smoke_the_step_loop_in_a_process_of_its_own(tmp_path):
    out = tmp_path / "load.json"
    argv = ["--model", str(DEMO_DIR), "--optimize", "none", "--schedulers", "step,step-process"]
    argv += ["--concurrency", "3", "--replies", "4", "--reply_tokens", "6"]
    assert chat_load.main([*argv, "--out", str(out)]) == 0
    step, apart = json.loads(out.read_text())["results"]
    assert apart["scheduler"] == "step-process" and apart["engine_process_replies"] == 4
    assert step["engine_process_replies"] is None and apart["texts"] == step["texts"] and all(step["texts"])


def test_the_serve_benchmarks_client_processes_import_no_torch():
    # Each spawned client process imports bench.chat_serve again (as its __main__) and bench.serve_clients:
    # eight of them importing torch at once took minutes on the H100's host.
    import subprocess
    import sys

    heavy = "{'torch', 'transformers'}"
    code = f"import sys, bench.chat_serve, bench.serve_clients; print(sorted({heavy} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_join_stage_smoke(tmp_path):
    out = tmp_path / "stage.json"
    assert join_stage.main(["--joiners", "1,5", "--repeats", "3", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["joiners"] for r in results] == [1, 5] and all(r["same"] for r in results)
    assert all(r["lists_ms"] > 0 and r["stage_ms"] > 0 for r in results)


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--joiners", "1,x", "--joiners takes comma-separated whole numbers, got '1,x'"),
        ("--joiners", "0", "--joiners, --sources and --repeats must be whole numbers of 1 or more"),
        ("--repeats", "0", "--joiners, --sources and --repeats must be whole numbers of 1 or more"),
    ],
)
def test_join_stage_refuses_bad_counts_by_name(flag, value, said, capsys):
    with pytest.raises(SystemExit):
        join_stage.main([flag, value])
    assert said in capsys.readouterr().err
