"""The app in a real browser: headless Chromium from Debian's ``chromium`` package, driven by
Playwright's Python API (no browser download). Chat a few turns, switch the kind, log in, train
a tiny model from the Train tab while its loss curve grows, then load the new checkpoint in the
chat's model picker and get a reply from it.

Skipped (with the reason) when Playwright or /usr/bin/chromium is missing; ``.ci/run`` installs
both, so CI runs it.
"""

from __future__ import annotations

import re
import time

import pytest
from browser import CHROMIUM, expect, needs_browser, sync_playwright
from served_app import serve

pytestmark = needs_browser

PASSWORD = "browser-test-password"
TRAIN_TIMEOUT_MS = 120_000
STEPS = 75  # optimizer steps of the tiny run: long enough for the 2 s redraw to catch it half-way
POINT = "[aria-label^='step: ']"  # vega draws one labelled mark per data point of a LinePlot


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve(tmp_path_factory, "browser", PASSWORD)


@pytest.fixture(scope="module")
def page(served):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.goto(served.url)
        yield page
        context.close()
        browser.close()


def bot_messages(page):
    return page.locator("[data-testid='bot']")


def send(page, text: str) -> str:
    """Type a message, wait for the bot's reply to finish, return it."""
    before = bot_messages(page).count()
    box = page.locator("#chat-input textarea")  # (its placeholder goes once the chat has started)
    box.fill(text)
    box.press("Enter")
    expect(bot_messages(page)).to_have_count(before + 1)
    # streaming is over when the textbox's stop button has gone again
    expect(page.locator("button.stop-button")).to_have_count(0)
    reply = bot_messages(page).last.inner_text().strip()
    assert reply and "Nothing was sent to the model" not in reply
    return reply


def plotted_steps(page, elem_id: str) -> list[int]:
    """The x values a LinePlot draws, read from vega's labelled marks (a hover mark repeats one)."""
    labels = page.locator(f"#{elem_id} {POINT}").evaluate_all("marks => marks.map(m => m.getAttribute('aria-label'))")
    return sorted({int(re.match(r"step: (\d+);", label).group(1)) for label in labels})


def fill(page, elem_id: str, value) -> None:
    page.locator(f"#{elem_id} input, #{elem_id} textarea").first.fill(str(value))  # (the train batch is text)


def test_chat_train_and_serve_the_new_model(served, page):
    started = time.perf_counter()
    # ---- chat a few turns, then switch the kind
    first = send(page, "hi! who are you?")
    send(page, "what do you like to do for fun?")
    page.get_by_role("radio", name="Emotion").check()
    expect(page.locator("#context-emotion input")).to_have_value("joyful")  # the emotion list replaces the text
    send(page, "i just got some great news!")
    assert bot_messages(page).first.inner_text().strip() == first  # the conversation stayed on the page

    # ---- before a login the Train tab's controls are locked, saying why; the password unlocks them
    page.get_by_role("tab", name="Train").click()
    expect(page.locator("#train-start")).to_be_disabled()
    expect(page.locator("#train-model input")).to_be_disabled()
    expect(page.locator("#train-lock-note")).to_contain_text("unlock when you log in")
    expect(page.locator("#train-show-command")).to_be_enabled()
    fill(page, "train-password", PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")
    expect(page.locator("#train-start")).to_be_enabled()
    expect(page.locator("#train-lock-note")).not_to_contain_text("unlock")
    page.locator("#train-more").get_by_text("More settings").click()  # batches, logging, beams: collapsed

    # ---- a tiny run: 1200 rows, batch 8 on 2 processes = 75 steps, a loss point every step
    for elem_id, value in (
        ("train-n-train", STEPS * 16),
        ("train-n-val", 8),
        ("train-epochs", 1),
        ("train-batch", 8),
        ("train-logging", 1),
        ("train-beams", 1),
    ):
        fill(page, elem_id, value)
    page.locator("#train-show-command").click()
    expect(page.locator("#train-command")).to_contain_text(f"--n_train {STEPS * 16}")
    page.locator("#train-start").click()
    expect(page.locator("#train-action")).to_contain_text("Started run")
    run_id = served.tab.manager.runs()[0]
    expect(page.locator("#train-run")).to_contain_text(f"Run {run_id}")

    # the loss curve grows while the run is running
    seen, deadline = [], time.monotonic() + TRAIN_TIMEOUT_MS / 1000
    while "finished" not in (text := page.locator("#train-run").inner_text()):
        assert "failed" not in text, text
        assert time.monotonic() < deadline, f"no result in time:\n{text}"
        points = len(plotted_steps(page, "train-loss"))
        if points and (not seen or points != seen[-1]):
            seen.append(points)
        time.sleep(0.3)
    # a partly drawn curve while it ran, growing (the timer redraws every 2 s)
    assert any(0 < n < STEPS for n in seen) and seen == sorted(seen), f"loss points seen while running: {seen}"
    expect(page.locator("#train-run")).to_contain_text("BLEU")
    expect(page.locator(f"#train-bleu {POINT}").first).to_be_attached()
    assert plotted_steps(page, "train-loss") == list(range(1, STEPS + 1))  # every step, after the last redraw
    assert plotted_steps(page, "train-bleu") == [STEPS]
    page.locator("#train-samples-panel").get_by_text("Sample replies").click()  # collapsed at first
    expect(page.locator("#train-samples")).to_contain_text("chatbot: ")  # sample replies of the validation set
    final = served.tab.manager.status(run_id).final_dir

    # ---- the new checkpoint is in the Chat tab's picker: load it and chat with it
    page.get_by_role("tab", name="Chat").click()
    page.get_by_role("button", name="Model").first.click()  # the accordion
    page.locator("#model-picker input").click()
    page.get_by_role("option", name=f"{run_id}/final").click()  # a substring of its label
    # (its 8 rows and 1 beam are not the demo model's measure: the two BLEU figures are not compared)
    expect(page.locator("#model-bleu")).to_contain_text("Not comparable with the serving model's BLEU")
    page.locator("#model-load").click()
    # (a load reads the weights from disk: seconds on a busy 2-core CI machine, more than expect's 5 s)
    expect(page.locator("#model-load-note")).to_contain_text(
        "measured differently, so they were not compared", timeout=60_000
    )
    expect(page.locator("#serving-status")).to_contain_text(f"Serving {run_id}/final")  # the short label
    assert served.engine.current.name == final
    # the conversation goes on with the new model: its reply, and a note after it that the model changed
    before = bot_messages(page).count()
    box = page.locator("#chat-input textarea")
    box.fill("hello again! how are you?")
    box.press("Enter")
    expect(bot_messages(page)).to_have_count(before + 2)
    expect(page.locator("#chat-log").get_by_text(f"The model changed: now {run_id}/final")).to_be_visible()

    # ---- logging out locks the Train tab again
    page.get_by_role("tab", name="Train").click()
    page.get_by_role("button", name="Log out").click()
    expect(page.locator("#train-start")).to_be_disabled()
    expect(page.locator("#train-lock-note")).to_contain_text("unlock when you log in")
    print(f"browser test: {time.perf_counter() - started:.1f} s, loss points seen while running: {seen}")
