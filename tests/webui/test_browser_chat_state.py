"""What the Chat tab remembers and shows across chats and pages, in a real browser (headless Debian
chromium through Playwright) on a desktop (1366x900) and on a phone (390x844):

- a saved chat, opened from the saved-chats list (also after a reload), gets back the kind, context
  and generation settings it was written with; New chat keeps the settings on the page;
- a model swapped on one page (a logged-in trainer's Load) is named in another page's serving banner
  by its next reply, and on opening its Chat tab, without a reload;
- the model picker shows every model's validation BLEU (the demo model's too), and a model that
  scored below the serving one (measured alike) is loaded only after a warning and a second Load.

Screenshots: in ``$PERSONA_CHAT_SCREENSHOTS`` if set, else a pytest temporary folder (printed).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from browser import VIEWPORTS, expect, needs_browser, screenshot_folder, shout
from served_app import App

from chat.engine import DEMO_DIR
from webui import auth, chat_handlers

pytestmark = needs_browser

PASSWORD = "browser-chat-state-password"
CHEF = "I am a chef who loves spicy food."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    app = App(tmp_path_factory.mktemp("browser-chat-state"), auth.AuthConfig(password=PASSWORD))
    shutil.copytree(DEMO_DIR, app.runs / "second" / "final")  # a finished run the model picker lists
    worse = app.runs / "worse" / "final"  # and one that scored far below the demo model, measured alike
    shutil.copytree(DEMO_DIR, worse)
    measure = json.loads((DEMO_DIR / "all_results.json").read_text())["eval_measure"]
    (worse / "all_results.json").write_text(json.dumps({"eval_bleu": 1.7, "eval_measure": measure}))
    yield app
    app.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = screenshot_folder(tmp_path_factory, "screenshots")
    yield folder
    shout(request, f"chat state browser screenshots: {folder}")


@pytest.fixture(params=list(VIEWPORTS))
def open_page(request, served, browser, shots):
    """Opens pages at the desktop or phone size, each in its own browser context (local storage)."""
    contexts = []

    def open_page(name: str = "a"):
        context = browser.new_context(viewport=VIEWPORTS[request.param])
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.goto(served.url)
        expect(page.locator("#chat-input textarea")).to_be_visible()
        page.shot = lambda shot: page.screenshot(
            path=shots / f"state-{shot}-{name}-{request.param}.png", full_page=True
        )
        return page

    yield open_page
    for context in contexts:
        context.close()


def send(page, text: str) -> None:
    before = page.locator("[data-testid='bot']").count()
    box = page.get_by_role("textbox", name="Message")
    box.fill(text)
    box.press("Enter")
    expect(page.locator("[data-testid='bot']")).to_have_count(before + 1)
    expect(page.locator("button.stop-button")).to_have_count(0)
    assert "Nothing was sent to the model" not in page.locator("[data-testid='bot']").last.inner_text()


def number(page, label: str):
    return page.get_by_role("spinbutton", name=re.compile(re.escape(label)))


def set_number(page, label: str, value) -> None:
    field = number(page, label)
    field.fill(str(value))
    field.press("Tab")


def open_settings(page) -> None:
    if not number(page, "Beams").is_visible():
        page.get_by_role("button", name=re.compile("^Generation settings")).click()
    expect(number(page, "Beams")).to_be_visible()


def expect_settings(page, kind: str, context_label: str, context: str, preset: str, beams, seed, max_new) -> None:
    expect(page.get_by_role("radio", name=kind)).to_be_checked()
    expect(page.get_by_role("textbox", name=context_label)).to_have_value(context)
    expect(page.get_by_role("radio", name=re.compile(f"^{preset}"))).to_be_checked()
    expect(number(page, "Beams")).to_have_value(str(beams))
    expect(number(page, "Seed")).to_have_value(str(seed))
    expect(number(page, "Max new tokens")).to_have_value(str(max_new))


def saved_chat(page, title: str):
    return page.get_by_role("gridcell", name=title)


def test_a_saved_chat_gets_back_who_the_bot_was_and_its_settings(open_page):
    page = open_page()
    open_settings(page)
    # Chat 1: a topic the user typed, the faithful preset, a seed and a shorter max.
    page.get_by_role("radio", name="Topic").check()
    expect(page.get_by_role("textbox", name="Topic")).to_have_value("jazz")  # the kind's default, then ours
    page.get_by_role("textbox", name="Topic").fill("the blues")
    page.get_by_role("radio", name=re.compile("^Faithful")).check()
    expect(number(page, "Beams")).to_have_value("10")  # the preset fills the sliders
    set_number(page, "Max new tokens", 24)
    set_number(page, "Seed", 42)
    send(page, "who do you listen to?")
    expect(page.get_by_role("gridcell")).to_have_count(1)  # saved (ChatInterface saves after the reply)
    # New chat: the settings stay as they are.
    page.get_by_role("button", name="New chat").click()
    expect(page.locator("[data-testid='bot']")).to_have_count(0)
    expect_settings(page, "Topic", "Topic", "the blues", "Faithful", 10, 42, 24)
    # Chat 2: a persona, the fast preset, other numbers.
    page.get_by_role("radio", name="Persona").check()
    expect(page.get_by_role("textbox", name="Persona")).to_have_value(chat_handlers.CHAT_E_PERSONA)
    page.get_by_role("textbox", name="Persona").fill(CHEF)
    page.get_by_role("radio", name=re.compile("^Fast")).check()
    expect(number(page, "Beams")).to_have_value("1")  # the preset's, then ours
    set_number(page, "Beams", 2)
    set_number(page, "Seed", 7)
    send(page, "what is for dinner?")
    expect(page.get_by_role("gridcell")).to_have_count(2)
    page.shot("1-second-chat")

    # Opening chat 1 brings back its topic and settings; chat 2 its persona and settings.
    saved_chat(page, "who do you listen to?").click()
    expect(page.locator("[data-testid='user']")).to_have_text(["who do you listen to?"])
    expect_settings(page, "Topic", "Topic", "the blues", "Faithful", 10, 42, 24)
    page.shot("2-first-chat-reopened")
    saved_chat(page, "what is for dinner?").click()
    expect_settings(page, "Persona", "Persona", CHEF, "Fast", 2, 7, 40)

    # Chat 1 goes on (its saved messages change) and still comes back with its settings, after a reload
    # too: the settings its reply was written with, not what the page shows when it is saved.
    saved_chat(page, "who do you listen to?").click()
    expect_settings(page, "Topic", "Topic", "the blues", "Faithful", 10, 42, 24)
    send(page, "and who else?")
    page.get_by_role("radio", name="Emotion").check()
    saved_chat(page, "what is for dinner?").click()
    expect_settings(page, "Persona", "Persona", CHEF, "Fast", 2, 7, 40)
    saved_chat(page, "who do you listen to?").click()
    expect(page.locator("[data-testid='user']")).to_have_count(2)
    expect_settings(page, "Topic", "Topic", "the blues", "Faithful", 10, 42, 24)
    page.reload()
    expect(page.locator("#chat-input textarea")).to_be_visible()
    open_settings(page)
    expect(page.get_by_role("radio", name="Persona")).to_be_checked()  # a fresh page: the defaults
    saved_chat(page, "who do you listen to?").click()
    expect(page.locator("[data-testid='user']")).to_have_text(["who do you listen to?", "and who else?"])
    expect_settings(page, "Topic", "Topic", "the blues", "Faithful", 10, 42, 24)
    page.shot("3-reopened-after-reload")
    saved_chat(page, "what is for dinner?").click()
    expect_settings(page, "Persona", "Persona", CHEF, "Fast", 2, 7, 40)


def load_model(page, option: str) -> None:
    """A logged-in trainer's Load of another model in the Chat tab's model picker (``option``: the
    start of its label)."""
    if not page.locator("#model-picker input").is_visible():
        page.get_by_role("button", name=re.compile("^Model")).click()  # the accordion
    page.locator("#model-picker input").click()
    page.get_by_role("option", name=option).click()
    page.locator("#model-load").click()
    # (this load's own note: the one of an earlier load also says "Now serving")
    expect(page.locator("#model-load-note")).to_contain_text(f"Now serving {option}", timeout=60_000)


def test_other_pages_name_the_new_model_after_a_swap(open_page, served):
    a, b = open_page("a"), open_page("b")
    banner_a, banner_b = a.locator("#serving-status"), b.locator("#serving-status")
    expect(banner_b).to_contain_text("Serving demo model")
    # Page A: a trainer logs in (Train tab) and loads the run from the Chat tab's model picker.
    a.get_by_role("tab", name="Train").click()
    a.locator("#train-password input").fill(PASSWORD)
    a.locator("#train-login").click()
    expect(a.locator("#train-auth")).to_contain_text("Logged in")
    a.get_by_role("tab", name="Chat").click()
    try:
        load_model(a, "second/final")
        expect(banner_a).to_contain_text("Serving second/final")
        expect(banner_b).to_contain_text("Serving demo model")  # page B has not asked anything yet
        # Page B's next reply comes from the new model, and its banner says so.
        send(b, "hi! who are you?")
        expect(banner_b).to_contain_text("Serving second/final")
        expect(b.get_by_role("gridcell")).to_have_count(1)  # saved: the screenshot shows its title
        b.shot("4-banner-after-reply")
        # Back to the demo model on page A; page B sees it on opening its Chat tab (here from Compare).
        load_model(a, "demo model")
        b.get_by_role("tab", name="Compare").click()
        b.get_by_role("tab", name="Chat").click()
        expect(banner_b).to_contain_text("Serving demo model")
        b.shot("5-banner-on-tab-select")
    finally:
        if served.engine.current.name != str(DEMO_DIR):  # the next viewport starts from the demo model
            served.engine.swap(str(DEMO_DIR))


def login(page) -> None:
    page.get_by_role("tab", name="Train").click()
    page.locator("#train-password input").fill(PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")
    page.get_by_role("tab", name="Chat").click()


def test_the_picker_shows_bleu_and_warns_before_a_worse_model(open_page, served):
    page = open_page("a")
    login(page)
    if not page.locator("#model-picker input").is_visible():
        page.get_by_role("button", name=re.compile("^Model")).click()
    page.locator("#model-picker input").click()
    options = page.get_by_role("option")
    demo = f"{chat_handlers.model_bleu(str(DEMO_DIR)):.1f}"
    expect(options.filter(has_text="demo model")).to_contain_text(f"BLEU {demo}")
    expect(options.filter(has_text="worse/final")).to_contain_text("BLEU 1.7")
    page.shot("6-picker-with-bleu")
    options.filter(has_text="worse/final").click()
    note, banner = page.locator("#model-load-note"), page.locator("#serving-status")
    try:
        page.locator("#model-load").click()
        expect(note).to_contain_text(f"scored BLEU 1.7 on its validation data, below the serving model's {demo}")
        expect(note).to_contain_text("Press Load again")
        expect(banner).to_contain_text("Serving demo model")  # nothing swapped yet
        page.shot("7-worse-model-warning")
        page.locator("#model-load").click()  # asked twice: the user means it
        expect(note).to_contain_text("Now serving worse/final", timeout=60_000)
        expect(banner).to_contain_text("Serving worse/final")
    finally:
        if served.engine.current.name != str(DEMO_DIR):
            served.engine.swap(str(DEMO_DIR))
