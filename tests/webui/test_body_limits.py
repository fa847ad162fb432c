"""Issue 28 item 2: every request body is bounded before it is read (api/limits.py), against the
running app. Bodies of 150 MB, declared (Content-Length) or streamed (chunked), to the unqueued
login endpoint, the queue and the REST routes get 413 after at most the bound is read, and the
server's memory does not grow by the body's size; chat, uploads (gradio's own limit) and login
keep working. Before: the login endpoint read 150 MB bodies whole (4 at once: 0.5 -> 2.4 GB)."""

import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
from gradio_client import Client
from served_app import App, fn_index, http_from, run_predict

from api.limits import MAX_BODY_BYTES
from webui import auth

PASSWORD = "body-limit-tests"
BODY = 150 * 2**20
CHUNK = b"x" * 2**20


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    served = App(tmp_path_factory.mktemp("bodies"), auth.AuthConfig(password=PASSWORD))
    yield served
    served.close()


def send_huge(app: App, path: str, chunked: bool) -> tuple[int, int, bytes]:
    """POST up to BODY bytes to ``path`` on a raw socket, 1 MB at a time, stopping as soon as the
    server answers. Returns (status, bytes sent, response body)."""
    url = urlsplit(app.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    framing = b"transfer-encoding: chunked" if chunked else f"content-length: {BODY}".encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n".encode()
        + framing
        + b"\r\n\r\n"
    )
    sent = 0
    try:
        while sent < BODY and not select.select([sock], [], [], 0.02 if sent < MAX_BODY_BYTES else 0.2)[0]:
            piece = b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK) if chunked else CHUNK
            sock.sendall(piece)
            sent += len(CHUNK)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < 2:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), sent, body


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/gradio_api/run/predict", "/gradio_api/queue/join", "/gradio_api/call/chat"])
def test_a_huge_body_is_refused_with_413_without_being_read(app, path, chunked):
    process = psutil.Process()  # the app serves from this process
    before = process.memory_info().rss
    status, sent, body = send_huge(app, path, chunked)
    grown = process.memory_info().rss - before
    assert status == 413, body
    assert "Request body too large" in json.loads(body)["detail"]
    # Refused when declared (after at most a few MB in flight) or at the bound when streamed.
    assert sent <= (MAX_BODY_BYTES + 8 * len(CHUNK) if chunked else 8 * len(CHUNK)), sent
    assert grown < 64 * 2**20, f"server grew {grown / 2**20:.0f} MiB"


def test_bodies_within_the_bound_chat_upload_and_login_still_work(app, tmp_path):
    assert Client(app.url, verbose=False).predict("hello!", "none", "", api_name="/chat")[0].strip()
    with http_from(app) as http:
        answer = run_predict(http, fn_index(app, "train_login"), [None, PASSWORD]).json()
        assert "Logged in" in json.dumps(answer)
        # gradio's upload route keeps its own, larger limit (max_file_size): 5 MB passes ours.
        big = tmp_path / "rows.jsonl"
        big.write_bytes(b'{"texts": "hi", "labels": "hello"}\n' * (5 * 2**20 // 36 + 1))
        with big.open("rb") as f:
            uploaded = http.post("gradio_api/upload", files={"files": ("rows.jsonl", f)})
        assert uploaded.status_code == 200 and uploaded.json()[0].endswith("rows.jsonl")
        # A body just under the bound is read and answered by the app itself (here: not JSON it knows).
        near = http.post("gradio_api/run/predict", content=b" " * (MAX_BODY_BYTES - 10), timeout=60)
        assert near.status_code not in (413, 500)


def test_four_huge_bodies_at_once_leave_memory_flat(app):
    """The issue's measurement: four 150 MB bodies at once to the login endpoint."""
    from concurrent.futures import ThreadPoolExecutor

    process = psutil.Process()
    before = process.memory_info().rss
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: send_huge(app, "/gradio_api/run/predict", i % 2 == 1), range(4)))
    grown = process.memory_info().rss - before
    assert [status for status, _, _ in results] == [413] * 4
    assert grown < 64 * 2**20, f"server grew {grown / 2**20:.0f} MiB"
    assert time.perf_counter() - started < 30
    assert httpx.get(app.url, timeout=10).status_code == 200  # and the app still serves pages
