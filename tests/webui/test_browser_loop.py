"""Issue 13's whole loop in a real browser (headless Debian chromium through Playwright, 1366x900):
an anonymous visitor chats with the served demo model and corrects two replies with ✏️; a trainer
logs in, accepts them in the Train tab's review panel and retrains the demo model on them; the new
model is measured against the old one on the corrections (mean log-likelihood per token of each
corrected reply given its exact encoder input, real models in this process); then the Compare tab
puts the old and the new model side by side and a vote lands in the win-rate table.

Nothing is mocked: the replies come from the demo model, the rows from SQLite, the run is a real
``accelerate launch`` on the CPU. Screenshots of each stage go to ``$PERSONA_CHAT_SCREENSHOTS`` if
set (else a pytest temporary folder, printed at the end); the cropped ``teach-*.png`` ones are the
README's images (docs/images/).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from browser import CHROMIUM, expect, needs_browser, screenshot_folder, shout, sync_playwright
from served_app import serve

from chat.engine import DEMO_DIR, ChatEngine, Conversation, load_checkpoint
from finetune.feedback import FeedbackRow, encoder_text

pytestmark = needs_browser

PASSWORD = "browser-loop-password"
TRAIN_TIMEOUT_S = 480  # a launch of 2 CPU processes, a few steps and one evaluation; shared cores
EPOCHS = 6  # 2 feedback rows on 2 processes: one optimizer step per epoch
# What the bot should have said: sentences the demo model would never write by itself.
MESSAGES = ("hi! who are you?", "what do you do on weekends?")
CORRECTIONS = (
    "I am Chat-E, a lighthouse keeper who collects blue seashells.",
    "On weekends I paint the lighthouse and teach my parrot to whistle.",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve(tmp_path_factory, "browser-loop", PASSWORD)


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = screenshot_folder(tmp_path_factory, "loop-screenshots")
    yield folder
    shout(request, f"loop browser screenshots: {folder}")


@pytest.fixture
def page(served, shots):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        context = browser.new_context(viewport={"width": 1366, "height": 900})
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.goto(served.url)
        expect(page.locator("#chat-input textarea")).to_be_visible()
        page.shot = lambda name: page.screenshot(path=shots / f"loop-{name}.png", full_page=True)
        yield page
        context.close()
        browser.close()


def bot_messages(page, where: str = "#chat-log"):
    return page.locator(f"{where} [data-testid='bot']")


def send(page, text: str) -> str:
    before = bot_messages(page).count()
    box = page.get_by_role("textbox", name="Message").first
    box.fill(text)
    box.press("Enter")
    expect(bot_messages(page)).to_have_count(before + 1)
    expect(page.locator("#chat-log button.stop-button, #chat-input button.stop-button")).to_have_count(0)
    reply = bot_messages(page).last.inner_text().strip()
    assert reply and "Nothing was sent to the model" not in reply
    return reply


def correct_last_reply(page, text: str) -> None:
    """✏️ on the newest bot reply, type what it should have said, submit."""
    bot_messages(page).last.hover()
    page.locator("#chat-log").get_by_role("button", name="Edit").last.click()
    editor = page.locator("#chat-log textarea.edit-textarea")
    editor.fill(text)
    page.locator("#chat-log").get_by_role("button", name="Submit").click()
    expect(editor).to_have_count(0)
    expect(bot_messages(page).last).to_have_text(text)


def fill(page, elem_id: str, value) -> None:
    page.locator(f"#{elem_id} input").fill(str(value))


def clip(page, path: Path, first: str, last: str) -> None:
    """A screenshot of the page from the top of ``first`` to the bottom of ``last`` (full width of both)."""
    top, bottom = page.locator(first).bounding_box(), page.locator(last).bounding_box()  # in the viewport
    left, down = page.evaluate("() => [window.scrollX, window.scrollY]")
    x = min(top["x"], bottom["x"]) + left
    width = max(top["x"] + top["width"], bottom["x"] + bottom["width"]) - x
    page.screenshot(path=path, full_page=True, clip={
        "x": x, "y": top["y"] + down, "width": width, "height": bottom["y"] + bottom["height"] - top["y"]})  # fmt: skip


def mean_log_likelihood(engine: ChatEngine, row: FeedbackRow) -> float:
    """Mean log-likelihood per token of ``row.response`` given the encoder input the chat builds
    for its conversation (the model's saved prefix and max length), teacher-forced."""
    loaded = engine.current
    encoded, _ = engine.build_input(Conversation(row.kind, row.context, row.turns), loaded)
    # the chat's input is exactly the training format's (finetune.feedback.encoder_text)
    assert encoded["input_ids"][0].tolist() == loaded.tokenizer(encoder_text(row, loaded.prefix)).input_ids
    labels = torch.tensor([loaded.tokenizer(text_target=row.response).input_ids])
    with torch.no_grad():
        loss = loaded.model(**encoded, labels=labels).loss  # mean negative log-likelihood per token
    return -float(loss)


def test_chat_correct_accept_retrain_measure_compare_vote(served, page, shots, request):
    started = time.perf_counter()
    store = served.tab.feedback_store()

    # ---- 1. an anonymous visitor chats and corrects two replies with ✏️
    originals = []
    for message, correction in zip(MESSAGES, CORRECTIONS):
        originals.append(send(page, message))
        correct_last_reply(page, correction)
    expect(page.locator("#feedback-note")).to_contain_text("correction saved for review (2 pending)")
    for bot, correction in zip(bot_messages(page).all(), CORRECTIONS):  # the chat went on from the corrections
        expect(bot).to_have_text(correction)
    page.shot("1-chat-corrected")
    page.locator("#chat-log").screenshot(path=shots / "teach-chat.png")
    pending = sorted(store.rows("pending"), key=lambda r: r.id)
    assert [(r.rating, r.response, r.original) for r in pending] == [
        ("correction", c, o) for c, o in zip(CORRECTIONS, originals)
    ]
    assert pending[1].turns == [MESSAGES[0], CORRECTIONS[0], MESSAGES[1]]  # the corrected reply, not the original
    assert all(r.kind == "persona" and r.model == str(DEMO_DIR) and r.visitor for r in pending)
    assert not any(r.visitor.startswith("trainer:") for r in pending)

    # ---- 2. a trainer logs in, reviews the two rows (with their encoder text) and accepts them
    page.get_by_role("tab", name="Train").click()
    fill(page, "train-password", PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")
    page.locator("#review").get_by_text(re.compile(r"^Feedback from the chat \(\d+ pending\)$")).click()
    expect(page.locator("#review")).to_contain_text("Feedback from the chat (2 pending)")  # redrawn on opening
    rows = page.locator("#review-rows [role=gridcell][data-col='0']")  # one per row
    expect(rows).to_have_count(2)
    expect(page.locator("#review-counts")).to_contain_text("2 pending")
    for correction in CORRECTIONS:
        expect(page.locator("#review-rows")).to_contain_text(correction)
    # newest first: the second correction's row; its encoder text is what the run will read
    page.locator("#review-rows [role=gridcell][data-row='0'][data-col='1']").click()
    expect(page.locator("#review-response textarea")).to_have_value(CORRECTIONS[1])
    detail = page.locator("#review-detail")
    expect(detail).to_contain_text(f"Row {pending[1].id}")
    assert " ".join(encoder_text(pending[1]).split()) in " ".join(detail.inner_text().split())
    page.shot("2-review-row")
    page.locator("#review").screenshot(path=shots / "teach-review.png")
    page.locator("#review-accept").click()
    expect(page.locator("#review-note")).to_contain_text(f"Row {pending[1].id}: accepted.")
    expect(rows).to_have_count(1)
    page.locator("#review-accept-all").click()  # the other one: "Accept all pending (1)"
    expect(page.locator("#review-note")).to_contain_text("1 pending row accepted.")
    expect(page.locator("#review-counts")).to_contain_text("0 pending · 2 accepted")
    assert sorted(r.id for r in store.rows("accepted")) == [r.id for r in pending]

    # ---- 3. a run on the accepted feedback only, from the served demo model
    page.locator("#train-feedback input[type=checkbox]").check()
    expect(page.locator("#train-model input")).to_have_value("demo model (bundled; what the chat serves offline)")
    # On a CPU the retrain defaults to a LoRA adapter; this loop fully fine-tunes the demo model (a full
    # model, which this step's chat engine and the Compare tab below load as they are)
    expect(page.locator("#train-adapter input[value=lora]")).to_be_checked()
    page.locator("#train-adapter").get_by_text("Full fine-tuning").click()
    ratio = page.locator("#train-feedback-ratio input[type=number]")
    ratio.fill("1")
    ratio.press("Enter")
    page.locator("#train-more").get_by_text("More settings").click()
    for elem_id, value in (("train-n-train", 16), ("train-n-val", 4), ("train-epochs", EPOCHS)):
        fill(page, elem_id, value)
    fill(page, "train-logging", 1)
    fill(page, "train-beams", 1)
    page.locator("#train-show-command").click()
    command = page.locator("#train-command")
    expect(command).to_contain_text("--feedback_file")
    expect(command).to_contain_text("--feedback_ratio 1")
    expect(command).to_contain_text("--model_name_or_path chat/demo_model")  # (the repository's paths shown relative)
    page.shot("3-train-form")
    page.locator("#train-start").click()
    expect(page.locator("#train-action")).to_contain_text("Started run")
    run_id = served.tab.manager.runs()[0]
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    while "finished" not in (text := page.locator("#train-run").inner_text()):
        assert "failed" not in text, text
        assert time.monotonic() < deadline, f"no result in time:\n{text}"
        time.sleep(1)
    page.shot("3-train-finished")
    status = served.tab.manager.status(run_id)
    final = status.final_dir
    assert status.step == EPOCHS  # the 2 feedback rows only (ratio 1), not the 16 sample rows too
    shout(request, f"run {run_id} finished, {status.step} steps, after {time.perf_counter() - started:.0f} s")

    # ---- 4. the new model moved toward the corrections: each one is likelier after than before
    before = ChatEngine(load_checkpoint(str(DEMO_DIR), optimize="none"), "before")
    after = ChatEngine(load_checkpoint(str(final), optimize="none"), "after")
    assert after.current.prefix == before.current.prefix
    measured = [(mean_log_likelihood(before, row), mean_log_likelihood(after, row)) for row in pending]
    shout(
        request,
        "mean log-likelihood per token of each correction (demo model -> retrained): "
        + "; ".join(f"{b:.3f} -> {a:.3f}" for b, a in measured),
    )
    assert all(a > b for b, a in measured), measured

    # ---- 5. Compare: A = the demo model (serving), B = the new run; one message, a vote for B
    page.get_by_role("tab", name="Compare").click()
    page.locator("#compare-pair").wait_for()
    page.get_by_role("button", name="Models").click()  # the accordion
    expect(page.locator("#compare-model-b input")).to_have_value(re.compile(f"^{run_id}/final"))  # the newest run
    expect(page.locator("#compare-model-a input")).to_have_value(re.compile(r"^demo model"))  # the serving one
    page.locator("#compare-model-b input").click()
    page.get_by_role("option", name=f"{run_id}/final").click()
    page.locator("#compare-load").click()
    # Loading B is a real model load: on a busy 2-core CI machine it outlasted expect's 5 s default.
    expect(page.locator("#compare-load-note")).to_contain_text("Comparing A demo model", timeout=30_000)
    expect(page.locator("#compare-pair")).to_contain_text(f"{run_id}/final")
    box = page.locator("#compare-input textarea")
    box.fill(MESSAGES[0])
    page.locator("#compare-send").click()
    expect(bot_messages(page, "#compare-a")).to_have_count(1)
    expect(bot_messages(page, "#compare-b")).to_have_count(1)
    expect(page.locator("#compare-vote-b")).to_be_enabled()
    replies = [bot_messages(page, f"#compare-{side}").inner_text().strip() for side in "ab"]
    assert all(replies), replies
    page.locator("#compare-vote-b").click()
    expect(page.locator("#compare-note")).to_contain_text("your vote is saved: B is better")
    expect(page.locator("#compare-vote-b")).to_be_disabled()  # one vote per reply pair
    expect(page.locator("#compare-table [role=gridcell][data-col='0']")).to_have_count(1)
    cells = [c.strip() for c in page.locator("#compare-table [role=gridcell][data-row='0']").all_inner_texts()]
    assert cells[:7] == ["demo model (tiny, bundled)", f"{run_id}/final", "0", "1", "0", "1", "0%"], cells
    (rate,) = store.win_rates()
    assert (rate["total"], rate["a_wins"] + rate["b_wins"], rate["ties"]) == (1, 1, 0)
    page.shot("5-compare-voted")
    clip(page, shots / "teach-compare.png", "#compare-pair", "#compare-table")
    shout(
        request,
        f"loop browser test: {time.perf_counter() - started:.0f} s; compare replies A={replies[0]!r} B={replies[1]!r}",
    )


def test_review_panel_label_counts_the_rows_pending_when_the_page_opens(served, page):
    store = served.tab.feedback_store()
    row = store.add(
        kind="none",
        context="",
        turns=["hello there"],
        response="Hello! Nice to meet you.",
        original="hi",
        rating="correction",
        model=str(DEMO_DIR),
        visitor=store.visitor_key("203.0.113.9"),
    )
    try:
        pending = store.counts()["pending"] + store.vote_counts()["pending"]  # votes wait for review too
        page.reload()  # a page opened after the row came in
        page.get_by_role("tab", name="Train").click()
        expect(page.locator("#review")).to_contain_text(f"Feedback from the chat ({pending} pending)", timeout=5_000)
    finally:
        store.delete([row])
