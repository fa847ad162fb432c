"""Two LoRA adapters on one base in a real browser (headless Debian chromium through Playwright), on
a desktop (1366x900) and on a phone (390x844), issue 25 item 4:

- the Chat tab's model picker lists both adapter runs with their base; a logged-in trainer loads
  one, then the other: each attaches to the served demo model (the base is not loaded again);
- a chat keeps the adapter it started with after the other is loaded; a new chat talks to the new one;
- the Compare tab compares the two adapters, with the one base in memory, and takes a vote.

The adapters are real peft adapters of the demo model (tests/adapter_files.py). Screenshots: in
``$PERSONA_CHAT_SCREENSHOTS`` if set, else a pytest temporary folder (printed).
"""

from __future__ import annotations

import re

import pytest
from adapter_files import make_adapter
from browser import VIEWPORTS, expect, needs_browser, screenshot_folder, shout
from served_app import App

from chat.engine import DEMO_DIR
from webui import auth

pytestmark = needs_browser

PASSWORD = "browser-adapters-password"
BOB, ANN = "bob/final (LoRA on demo model)", "ann/final (LoRA on demo model)"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser-adapters")
    make_adapter(DEMO_DIR, root / "runs" / "ann", seed=1, scale=0.3)  # two finished runs, before the app starts
    make_adapter(DEMO_DIR, root / "runs" / "bob", seed=2, scale=0.3)
    app = App(root, auth.AuthConfig(password=PASSWORD))
    yield app
    app.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = screenshot_folder(tmp_path_factory, "screenshots")
    yield folder
    shout(request, f"adapter browser screenshots: {folder}")


@pytest.fixture(params=list(VIEWPORTS))
def page(request, served, browser, shots):
    context = browser.new_context(viewport=VIEWPORTS[request.param])
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(served.url)
    expect(page.locator("#chat-input textarea")).to_be_visible()
    page.shot = lambda shot: page.screenshot(path=shots / f"adapters-{shot}-{request.param}.png", full_page=True)
    yield page
    context.close()
    served.engine.swap(str(DEMO_DIR))  # the next viewport starts from the demo model alone


def starts(label: str) -> re.Pattern:
    """A pattern for an option whose label starts with ``label`` (Playwright's selector needs "/" escaped)."""
    return re.compile("^" + re.escape(label).replace("/", r"\/"))


def bot_messages(page, where: str = "#chat-log"):
    return page.locator(f"{where} [data-testid='bot']")


def send(page, text: str) -> str:
    before = bot_messages(page).count()
    box = page.get_by_role("textbox", name="Message")
    box.fill(text)
    box.press("Enter")
    expect(bot_messages(page)).to_have_count(before + 1)
    expect(page.locator("button.stop-button")).to_have_count(0)
    reply = bot_messages(page).last.inner_text().strip()
    assert reply and "Nothing was sent to the model" not in reply, reply
    return reply


def load_model(page, label: str) -> None:
    """A logged-in trainer's Load of a model in the Chat tab's picker (``label``: its label's start)."""
    if not page.locator("#model-picker input").is_visible():
        page.get_by_role("button", name=re.compile("^Model")).click()  # the accordion
    page.locator("#model-picker input").click()
    page.get_by_role("option", name=starts(label)).click()
    page.locator("#model-load").click()
    expect(page.locator("#model-load-note")).to_contain_text(f"Now serving {label}", timeout=60_000)


def pick(page, elem_id: str, label: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.locator(f"#{elem_id}").get_by_role("option", name=starts(label)).click()


def test_two_adapters_on_one_base_in_the_chat_and_the_compare_tab(page, served):
    base = served.engine.base.model
    page.get_by_role("tab", name="Train").click()
    page.locator("#train-password input").fill(PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")
    page.get_by_role("tab", name="Chat").click()
    banner = page.locator("#serving-status")

    # ---- both adapter runs are listed with their base; loading one attaches it to the served base
    page.get_by_role("button", name=re.compile("^Model")).click()
    page.locator("#model-picker input").click()
    expect(page.get_by_role("option", name=starts(f"{BOB} · "))).to_have_count(1)
    expect(page.get_by_role("option", name=starts(f"{ANN} · "))).to_have_count(1)
    page.shot("1-picker")
    page.get_by_role("option", name=starts(BOB)).click()
    page.locator("#model-load").click()
    expect(page.locator("#model-load-note")).to_contain_text(f"Now serving {BOB}", timeout=60_000)
    expect(banner).to_contain_text(f"Serving {BOB}")
    bob = send(page, "hi! who are you?")
    page.shot("2-chat-bob")

    # ---- the other adapter on the same base: the chat keeps bob, a new chat gets ann
    load_model(page, ANN)
    assert served.engine.base.model is base and served.engine.current.model is base  # no base loaded again
    assert served.engine.model_ids() == ["demo-model", "bob", "ann"]
    send(page, "what do you like to do?")  # the same chat: still bob
    expect(banner).to_contain_text(f"Serving {BOB}")
    page.get_by_role("button", name="New chat").click()
    ann = send(page, "hi! who are you?")
    expect(banner).to_contain_text(f"Serving {ANN}")
    assert ann != bob  # each adapter answers in its own way (same message, same settings)
    page.shot("3-chat-ann")

    # ---- Compare: bob against ann, on the one base
    page.get_by_role("tab", name="Compare").click()
    page.locator("#compare-pair").wait_for()
    page.get_by_role("button", name="Models").click()  # the accordion
    pick(page, "compare-model-a", BOB)
    pick(page, "compare-model-b", ANN)
    page.locator("#compare-load").click()
    expect(page.locator("#compare-load-note")).to_contain_text("Comparing A bob/final with B ann/final")
    slot = served.demo.compare.slot
    assert slot.extra is None and served.engine.base.model is base  # one base model in memory
    page.locator("#compare-input textarea").fill("hi! who are you?")
    page.locator("#compare-send").click()
    expect(bot_messages(page, "#compare-a")).to_have_count(1)
    expect(bot_messages(page, "#compare-b")).to_have_count(1)
    expect(page.locator("#compare-vote-a")).to_be_enabled()
    replies = [bot_messages(page, f"#compare-{side}").inner_text().strip() for side in "ab"]
    assert replies == [bob, ann], replies  # each side is its adapter, as in the chat
    page.locator("#compare-vote-a").click()
    expect(page.locator("#compare-note")).to_contain_text("your vote is saved: A is better")
    page.shot("4-compare")
    assert served.engine.current.id == "ann"  # comparing changed nothing the chat serves
