"""Issue 27's loop in a real browser (headless Debian chromium through Playwright, 1366x900): an
anonymous visitor likes, dislikes and corrects the demo model's replies in the chat and votes in
Compare (a win and a tie); the trainer logs in, sees the vote beside the rows, accepts them all,
picks the DPO objective (the line counts the pairs from corrections and votes and the KTO rows),
checks Show command's flags and trains the demo model with DPO on the CPU; the new model prefers
the chosen replies on held-out rows it was not trained on: the run's eval_pref_accuracy, shown
in the run line, its plot and the model picker, above the demo model's on the same rows.

The visitor's handful of rows are too few to hold any out, so the store also holds the trainer's
own earlier corrections, made the way a correction is (issue 27's "Done when"): the shipped sample
preference set (data/sample/preferences-validation.jsonl, finetune.sample_preferences: a sample
conversation, chosen = the dataset's reply, rejected = the demo model's own greedy reply).
Nothing is mocked: the replies come from the models, the rows from SQLite, the run is a real
``accelerate launch`` on the CPU. Screenshots go to ``$PERSONA_CHAT_SCREENSHOTS`` if set (else a
pytest temporary folder, printed at the end).
"""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
import torch
from browser import CHROMIUM, expect, needs_browser, screenshot_folder, shout, sync_playwright
from served_app import serve
from test_browser_loop import bot_messages, correct_last_reply, fill

from chat.engine import DEMO_DIR, load_checkpoint
from chat.layout import SAMPLE_DIR
from chat.prompt import _CONTEXT_TEMPLATE, kind_of, split_source
from finetune.feedback_preferences import preference_rows
from finetune.jobs.status import saved_results
from finetune.preference_data import HOLDOUT_EVERY

pytestmark = needs_browser

PASSWORD = "browser-preferences-password"
TRAIN_TIMEOUT_S = 600  # a launch of 2 CPU processes (minutes on a busy shared CPU), 28 steps, five evaluations
SEEDED = 56  # the trainer's earlier corrections: with the visitor's 2 pairs, 58 rows, 5 held out
# DPO settings that move the demo model on this little data in a few steps (python -m finetune on the
# same 59 rows, one process, batch 8: held-out preference accuracy 0.0 at the start, 0.6 after one
# epoch, 0.8 after four); BLEU falls ~6 points, which the run flags.
FORM = {"train-epochs": 4, "train-beta": 0.5, "train-sft-weight": 1, "train-n-train": 16, "train-n-val": 8}
LEARNING_RATE, BATCH = "1e-3", 4  # 4 per process x 2 processes: 8 rows a step
CORRECTION = "I am Chat-E, a lighthouse keeper who collects blue seashells."


def structured(texts: str) -> tuple[str, str, list[str]]:
    """(kind, context, turns) of a sample row's ``texts`` (chat.prompt's format, inverted)."""
    kind = kind_of(texts)
    context_text, turns = split_source(texts)
    head, tail = _CONTEXT_TEMPLATE[kind].split("{}") if kind != "none" else ("", "")
    return kind, context_text[len(head) : len(context_text) - len(tail)], turns


def seed_corrections(served) -> int:
    """The trainer's earlier corrections of the demo model, accepted: the sample preference set's
    first SEEDED pairs as correction rows (the correction = chosen, the bot's reply = rejected)."""
    store = served.tab.feedback_store()
    lines = (SAMPLE_DIR / "preferences-validation.jsonl").read_text().splitlines()[:SEEDED]
    for line in lines:
        row = json.loads(line)
        kind, context, turns = structured(row["texts"])
        conversation = {"kind": kind, "context": context, "turns": turns, "model": str(DEMO_DIR)}
        store.add(**conversation, response=row["chosen"], original=row["rejected"], rating="correction",
                  visitor="trainer:earlier", status="accepted")  # fmt: skip
    return len(lines)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_path):
    for app in serve(tmp_path_factory, "browser-preferences", PASSWORD):
        # Compare's pair, chosen by a trainer earlier (tests/webui/test_browser_loop.py walks that choice):
        # the demo model against an untrained tiny model (a copy as a finished run: its replies differ)
        other = app.runs / "untrained-tiny" / "final"
        shutil.copytree(tiny_path, other)
        app.demo.compare.slot.choose(str(DEMO_DIR), str(other))
        yield app


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = screenshot_folder(tmp_path_factory, "preference-screenshots")
    yield folder
    shout(request, f"preference browser screenshots: {folder}")


@pytest.fixture
def page(served, shots):
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        context = browser.new_context(viewport={"width": 1366, "height": 900})
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.goto(served.url)
        expect(page.locator("#chat-input textarea")).to_be_visible(timeout=60_000)  # (a busy shared CPU)
        page.shot = lambda name: page.screenshot(path=shots / f"pref-{name}.png", full_page=True)
        yield page
        context.close()
        browser.close()


def send(page, text: str) -> str:
    """Send ``text`` in the chat and wait for the whole reply (a minute: the CPU may be shared)."""
    before = bot_messages(page).count()
    box = page.get_by_role("textbox", name="Message").first
    box.fill(text)
    box.press("Enter")
    expect(bot_messages(page)).to_have_count(before + 1, timeout=60_000)
    stop = page.locator("#chat-log button.stop-button, #chat-input button.stop-button")
    expect(stop).to_have_count(0, timeout=60_000)
    reply = bot_messages(page).last.inner_text().strip()
    assert reply and "Nothing was sent to the model" not in reply
    return reply


def rate_last_reply(page, name: str) -> None:
    bot_messages(page).last.hover()
    page.locator("#chat-log").get_by_role("button", name=name).last.click()
    expect(page.locator("#feedback-note")).to_contain_text(f"{name.lower()} saved for review")


def compare_and_vote(page, message: str, button: str) -> list[str]:
    page.locator("#compare-clear").click()
    expect(bot_messages(page, "#compare-a")).to_have_count(0)
    page.locator("#compare-input textarea").fill(message)
    page.locator("#compare-send").click()
    expect(page.locator(f"#compare-vote-{button}")).to_be_enabled(timeout=60_000)
    replies = [bot_messages(page, f"#compare-{side}").last.inner_text().strip() for side in "ab"]
    page.locator(f"#compare-vote-{button}").click()
    expect(page.locator("#compare-note")).to_contain_text("your vote is saved")
    return replies


@torch.no_grad()
def prefers_chosen(model_dir, rows: list[dict]) -> float:
    """Share of ``rows`` where the model gives the chosen reply a higher summed log-probability than
    the rejected one (eval_pref_accuracy's definition), each given its exact training input."""
    from finetune.data import fitted_sources

    loaded = load_checkpoint(str(model_dir), optimize="none")
    model, tok = loaded.model, loaded.tokenizer
    right = 0
    for row in rows:
        source = fitted_sources([row["texts"]], tok, loaded.prefix, 128)[0]
        encoded = tok(source, max_length=128, truncation=True, return_tensors="pt")
        scores = []
        for reply in (row["chosen"], row["rejected"]):
            labels = torch.tensor([tok(text_target=reply, max_length=64, truncation=True).input_ids])
            logits = model(**encoded, labels=labels).logits
            scores.append(torch.log_softmax(logits, -1).gather(-1, labels[..., None]).sum().item())
        right += scores[0] > scores[1]
    return right / len(rows)


def test_like_dislike_correct_vote_accept_train_dpo_and_the_model_prefers_the_chosen(served, page, request):
    started = time.perf_counter()
    store = served.tab.feedback_store()
    seeded = seed_corrections(served)
    shout(request, f"{seeded} earlier corrections seeded after {time.perf_counter() - started:.0f} s")

    # ---- 1. an anonymous visitor rates three replies and corrects one in the chat
    send(page, "hi! who are you?")
    rate_last_reply(page, "Like")
    disliked = send(page, "what do you do on weekends?")
    rate_last_reply(page, "Dislike")
    original = send(page, "do you have pets?")
    correct_last_reply(page, CORRECTION)
    expect(page.locator("#feedback-note")).to_contain_text("correction saved for review (3 pending)")
    page.shot("1-chat-rated")

    # ---- 2. ... and votes in Compare: A wins one reply pair, another is a tie
    page.get_by_role("tab", name="Compare").click()
    won = compare_and_vote(page, "hello! what is your job?", "a")
    compare_and_vote(page, "do you like music?", "tie")
    page.shot("2-compare-voted")
    (vote,) = store.votes("pending")  # the tie is kept for the win rates, never offered as a pair
    assert (vote.chosen, vote.rejected, vote.turns) == (won[0], won[1], ["hello! what is your job?"])
    assert store.win_rates()[0]["total"] == 2

    # ---- 3. the trainer logs in, sees the vote beside the rows and accepts them all
    page.get_by_role("tab", name="Train").click()
    fill(page, "train-password", PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")
    page.locator("#review").get_by_text(re.compile(r"^Feedback from the chat \(\d+ pending\)$")).click()
    expect(page.locator("#review")).to_contain_text("Feedback from the chat (4 pending)")
    expect(page.locator("#review-counts")).to_contain_text("Compare votes: 1 pending")
    page.locator("#review-rows [role=gridcell][data-row='0'][data-col='1']").click()  # newest first: the vote
    expect(page.locator("#review-detail")).to_contain_text(f"Vote v{vote.id}")
    expect(page.locator("#review-detail")).to_contain_text("Chosen: the winner's reply (demo model (tiny, bundled))")
    page.shot("3-review-vote")
    page.locator("#review-accept-all").click()
    expect(page.locator("#review-note")).to_contain_text("3 pending rows and 1 Compare vote accepted.")
    pairs = preference_rows(store, "dpo")
    assert len(pairs) == seeded + 2  # the seeded corrections, the visitor's correction, the vote
    assert [(p["chosen"], p["rejected"]) for p in pairs[-2:]] == [(CORRECTION, original), tuple(won)]
    assert [(r["response"], r["label"]) for r in preference_rows(store, "kto")][-1] == (disliked, False)

    # ---- 4. DPO from the demo model on the accepted feedback
    page.locator("#train-objective").get_by_text("DPO: chosen over rejected").click()
    counts = page.locator("#train-pref-counts")
    expect(counts).to_contain_text(f"{seeded + 1} pairs from corrections · 1 pair from Compare votes · 2 KTO rows")
    held = len(pairs) // HOLDOUT_EVERY
    expect(counts).to_contain_text(f"DPO trains on {len(pairs) - held} and measures preference accuracy on {held}")
    page.locator("#train-model input").click()
    page.get_by_role("option", name=re.compile(r"^demo model")).click()
    page.locator("#train-more").get_by_text("More settings").click()
    for elem_id, value in FORM.items():
        fill(page, elem_id, value)
    page.get_by_label("Learning rate", exact=True).fill(LEARNING_RATE)
    page.locator("#train-batch textarea, #train-batch input").first.fill(str(BATCH))
    fill(page, "train-logging", 1)
    fill(page, "train-beams", 1)
    page.locator("#train-show-command").click()
    command = page.locator("#train-command")
    for flag in ("--objective dpo", "--beta 0.5", "--sft_weight 1.0", "--model_name_or_path chat/demo_model"):
        expect(command).to_contain_text(flag)
    expect(command).to_contain_text(
        re.compile(r"--preference_file \S*/feedback/exports/preferences-dpo-\w+/dpo\.jsonl")
    )
    page.shot("4-train-form")
    page.locator("#train-start").click()
    expect(page.locator("#train-action")).to_contain_text("Started run")
    run_id = served.tab.manager.runs()[0]
    deadline = time.monotonic() + TRAIN_TIMEOUT_S
    while "finished" not in (text := page.locator("#train-run").inner_text()):
        assert "failed" not in text, text
        assert time.monotonic() < deadline, f"no result in time:\n{text}"
        time.sleep(1)
    final = served.tab.manager.status(run_id).final_dir
    argv = json.loads((served.runs / run_id / "run.json").read_text())["argv"]  # what Start ran: Show command's
    assert [argv[argv.index(f) + 1] for f in ("--learning_rate", "--per_device_train_batch_size")] == ["0.001", "4"]
    shout(request, f"DPO run {run_id} finished after {time.perf_counter() - started:.0f} s")

    # ---- 5. the new model prefers the chosen replies on the held-out rows
    accuracy = saved_results(final)["eval_pref_accuracy"]
    events = [json.loads(line) for line in (served.runs / run_id / "metrics.jsonl").read_text().splitlines()]
    start = next(e for e in events if e.get("event") == "eval" and e.get("step") == 0)["eval_pref_accuracy"]
    expect(page.locator("#train-run")).to_contain_text(f"preference accuracy {100 * accuracy:.0f}%")
    expect(page.locator("#train-pref")).to_be_visible()
    page.shot("5-train-finished")
    command_file = json.loads((served.runs / run_id / "run.json").read_text())["spec"]["config"]["preference_file"]
    rows = [json.loads(line) for line in open(command_file)]
    texts = [{**r, "texts": _texts(r)} for r in rows]
    held_out = [r for i, r in enumerate(texts, 1) if i % HOLDOUT_EVERY == 0]  # what the run held out
    before, after = prefers_chosen(DEMO_DIR, held_out), prefers_chosen(final, held_out)
    shout(
        request, f"held-out preference accuracy ({len(held_out)} rows): demo model {before:.2f} -> DPO run {after:.2f}"
    )
    # the run's figures are this measure on these rows, before (its step-0 evaluation) and after
    assert (before, after) == (pytest.approx(start, abs=1e-6), pytest.approx(accuracy, abs=1e-6))
    assert accuracy > 0.5 and accuracy > start, (start, accuracy)
    # the Chat tab's model picker lists the run with its preference accuracy
    page.get_by_role("tab", name="Chat").click()
    if not page.locator("#model-picker input").is_visible():  # the accordion, unless a finished run opened it
        page.locator(":is(button, span):text-is('Model'):visible").first.click()
    expect(page.locator("#model-picker input")).to_be_visible()
    # (on main after the runs/batching merges the picker did not list a run finished while the Train tab
    # was shown until Refresh; before them it did: reported to the lead)
    page.locator("button:visible", has_text=re.compile(r"^\s*Refresh\s*$")).last.click()
    page.locator("#model-picker input").click()
    listed = page.get_by_role("option").filter(has_text=f"{run_id}/final")
    expect(listed).to_contain_text(f"pref {100 * accuracy:.0f}%")
    page.shot("6-picker")
    shout(request, f"preference browser test: {time.perf_counter() - started:.0f} s")


def _texts(row: dict) -> str:
    from chat.prompt import build_source

    return build_source(row["kind"], row["context"], row["turns"])
