"""The events issue 28 item 4 changed, in a real browser (headless Debian chromium, 1366x900): a ✏️
correction in the chat with text holding an escape sequence and a right-to-left override (shown and
stored without them), then the trainer's review: selecting the row, accepting it and exporting, the
export saved as a .jsonl download carried by the answer to the logged-in event itself, never by a
file gradio would serve to anyone who asks for its path (the anonymous GET of the server's copy is
refused in tests/webui/test_text_hygiene.py)."""

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
CORRECTION = "I am Chat-E, a lighthouse keeper."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve(tmp_path_factory, "browser-export", PASSWORD)


def test_correct_review_and_download_the_export(served, browser, tmp_path):
    store = FeedbackStore(Path(served.data) / "feedback" / "feedback.sqlite3")
    context = browser.new_context(viewport={"width": 1366, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        page.goto(served.url)
        box = page.get_by_role("textbox", name="Message").first
        box.fill("hi! who are you?")
        box.press("Enter")
        bot = page.locator("#chat-log [data-testid='bot']")
        expect(bot).to_have_count(1)
        expect(page.locator("#chat-log button.stop-button, #chat-input button.stop-button")).to_have_count(0)
        # ✏️ the reply (the edit event): what is stored, and shown, is the text without its controls
        bot.last.hover()
        page.locator("#chat-log").get_by_role("button", name="Edit").last.click()
        page.locator("#chat-log textarea.edit-textarea").fill(f"\x1b[31m{CORRECTION}\u202e")
        page.locator("#chat-log").get_by_role("button", name="Submit").click()
        expect(page.locator("#feedback-note")).to_contain_text("correction saved for review (1 pending)")
        expect(bot.last).to_have_text(CORRECTION)
        assert store.rows()[0].response == CORRECTION

        # the trainer selects the row (the select event), accepts it and exports
        page.get_by_role("tab", name="Train").click()
        page.locator("#train-password input").fill(PASSWORD)
        page.locator("#train-login").click()
        expect(page.locator("#train-auth")).to_contain_text("Logged in")
        page.locator("#review").get_by_text(re.compile(r"^Feedback from the chat \(\d+ pending\)$")).click()
        page.locator("#review-rows [role=gridcell][data-row='0'][data-col='1']").click()
        expect(page.locator("#review-response textarea")).to_have_value(CORRECTION)
        expect(page.locator("#review-detail")).to_contain_text(f"Row {store.rows()[0].id}")
        page.locator("#review-accept").click()
        expect(page.locator("#review-note")).to_contain_text("accepted.")
        with page.expect_download() as download_info:
            page.locator("#review-export").click()
        download = download_info.value
        assert re.fullmatch(r"feedback-\d{8}-\d{6}\.jsonl", download.suggested_filename)
        assert download.url.startswith("blob:")  # made in the page from the event's answer, not a served file
        saved = tmp_path / download.suggested_filename
        download.save_as(saved)
        rows = [json.loads(line) for line in saved.read_text(encoding="utf-8").splitlines()]
        assert [(r["response"], r["turns"]) for r in rows] == [(CORRECTION, ["hi! who are you?"])]
        expect(page.locator("#review-note")).to_contain_text(
            f"Exported 1 accepted row: your browser saves it as {saved.name}"
        )
    finally:
        context.close()
