"""The review panel's export in a real browser (headless Debian chromium, 1366x900): the logged-in
trainer's click saves the accepted rows as a .jsonl download, carried by the answer to the logged-in
event itself and never by a file gradio would serve to anyone who asks for its path (issue 28 item 4;
the anonymous GET of the server's copy is refused in tests/webui/test_text_hygiene.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from browser import expect, needs_browser
from served_app import serve

from finetune.feedback import FeedbackStore

pytestmark = needs_browser

PASSWORD = "browser-export-password"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve(tmp_path_factory, "browser-export", PASSWORD)


def test_the_trainer_downloads_the_accepted_rows(served, browser, tmp_path):
    store = FeedbackStore(Path(served.data) / "feedback" / "feedback.sqlite3")
    for i in range(2):
        store.add(kind="topic", context="jazz", turns=[f"who plays {i}?"], response=f"miles davis {i}",
                  rating="correction", visitor="v", status="accepted")  # fmt: skip
    context = browser.new_context(viewport={"width": 1366, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        page.goto(served.url)
        page.get_by_role("tab", name="Train").click()
        page.locator("#train-password input").fill(PASSWORD)
        page.locator("#train-login").click()
        expect(page.locator("#train-auth")).to_contain_text("Logged in")
        page.locator("#review").get_by_text(re.compile(r"^Feedback from the chat \(\d+ pending\)$")).click()
        with page.expect_download() as download_info:
            page.locator("#review-export").click()
        download = download_info.value
        assert re.fullmatch(r"feedback-\d{8}-\d{6}\.jsonl", download.suggested_filename)
        saved = tmp_path / download.suggested_filename
        download.save_as(saved)
        rows = [json.loads(line) for line in saved.read_text(encoding="utf-8").splitlines()]
        assert [r["response"] for r in rows] == ["miles davis 0", "miles davis 1"] and rows[0]["kind"] == "topic"
        expect(page.locator("#review-note")).to_contain_text(
            f"Exported 2 accepted rows: your browser saves them as {saved.name}"
        )
        assert download.url.startswith("blob:")  # made in the page from the event's answer, not a served file
    finally:
        context.close()
