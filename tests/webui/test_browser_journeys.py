"""The journeys a new user found broken (issue 28, items 7-15), in a real browser (headless Debian
chromium through Playwright) on a desktop (1366x900) and on a phone (390x844):

- an example sends its own kind and context (the token meter counts that context, not the persona);
- a refused login, a lockout, a refused Start or review action say why on the page, in the line
  under the button (not a bare "Error" badge, not a toast under a line that says "Started run");
- on a phone the message box and who the bot is are on the first screen, in the Chat and the
  Compare tab; the win-rate table fits the screen;
- the keyboard: a visible focus ring on every control, one Tab stop per radio group; text and
  controls meet WCAG AA contrast (measured from the browser's computed styles); disabled buttons
  look disabled; no status is an emoji alone;
- a model swapped on another page: the picker follows and the chat says the model changed;
- after a reload no saved chat looks open while the chat is a new one.

Screenshots: in ``$PERSONA_CHAT_SCREENSHOTS`` if set, else a pytest temporary folder (printed).
"""

from __future__ import annotations

import re
import shutil
import time

import pytest
from browser import VIEWPORTS, expect, needs_browser, screenshot_folder, shout
from served_app import App

from chat.engine import DEMO_DIR, Conversation
from finetune.jobs.command import free_port
from webui import auth, chat_handlers

pytestmark = needs_browser

PASSWORD = "browser-journeys-password"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    app = App(tmp_path_factory.mktemp("browser-journeys"), auth.AuthConfig(password=PASSWORD))
    shutil.copytree(DEMO_DIR, app.runs / "second" / "final")  # a finished run to load
    yield app
    app.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = screenshot_folder(tmp_path_factory, "screenshots")
    yield folder
    shout(request, f"journeys browser screenshots: {folder}")


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
        page.size = request.param
        page.shot = lambda shot: page.screenshot(
            path=shots / f"journey-{shot}-{name}-{request.param}.png", full_page=True
        )
        page.first_screen = lambda shot: page.screenshot(path=shots / f"journey-{shot}-{name}-{request.param}.png")
        return page

    yield open_page
    for context in contexts:
        context.close()


def bot_messages(page, where: str = "#chat-log"):
    return page.locator(f"{where} [data-testid='bot']")


def wait_for_reply(page, count: int) -> str:
    expect(bot_messages(page)).to_have_count(count)
    expect(page.locator("#chat-input button.stop-button")).to_have_count(0)  # streaming is over
    reply = bot_messages(page).last.inner_text().strip()
    assert reply and "Nothing was sent to the model" not in reply
    return reply


def send(page, text: str) -> str:
    before = bot_messages(page).count()
    box = page.get_by_role("textbox", name="Message").first
    box.fill(text)
    box.press("Enter")
    return wait_for_reply(page, before + 1)


def login(page) -> None:
    page.get_by_role("tab", name="Train").click()
    page.locator("#train-password input").fill(PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")


# --------------------------------------------------------------------------- item 7: examples


def test_each_example_sends_its_own_kind_and_context(open_page, served):
    page = open_page()
    meter = page.locator("#token-meter")
    for (message, kind, context), label in zip(chat_handlers.EXAMPLES, chat_handlers.EXAMPLE_LABELS, strict=True):
        if bot_messages(page).count():
            page.get_by_role("button", name="New chat").click()  # the examples show in an empty chat
            expect(bot_messages(page)).to_have_count(0)
        page.get_by_role("button", name=label).click()
        wait_for_reply(page, 1)
        expect(page.locator("[data-testid='user']")).to_have_text([message])  # sent once
        expect(page.locator("#chat-input textarea")).to_have_value("")  # and not left in the box
        radio = next(shown for shown, value in chat_handlers.KIND_CHOICES if value == kind)
        expect(page.get_by_role("radio", name=radio)).to_be_checked()
        # what the model was given: the meter counts the example's context (Topic's 9, not the persona's 47)
        _, budget = served.engine.build_input(Conversation(kind, context, [message]))
        expect(meter).to_contain_text(f"context {budget.context_tokens} + ")
    page.shot("7-last-example")


# --------------------------------------------------------------------------- item 8: refusals on the page


def test_a_wrong_password_and_a_lockout_say_why_under_the_login(open_page, served):
    page = open_page()
    page.get_by_role("tab", name="Train").click()
    note = page.locator("#train-login-note")
    try:
        for _ in range(auth.MAX_FAILURES):
            page.locator("#train-password input").fill("not the password")
            page.locator("#train-login").click()
            expect(note).to_contain_text("Wrong password.")
            page.locator("#train-password input").fill("")
        page.locator("#train-password input").fill(PASSWORD)  # even the right one, while locked out
        page.locator("#train-password input").press("Enter")
        expect(note).to_contain_text(re.compile(r"Too many wrong passwords from your address: try again in \d+ s"))
        assert note.get_attribute("role") == "status"  # announced by screen readers
        assert not page.locator("#train-auth .wrap.error, #train-login-note .wrap.error").count()
        page.first_screen("8-lockout")
    finally:
        served.tab.auth.throttle.succeeded("127.0.0.1")  # the next viewport's page logs in
    page.locator("#train-password input").fill(PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")
    expect(note).to_have_text("")  # the refusal is gone once it no longer holds


def test_a_refused_start_says_why_in_the_action_line(open_page, served, capfd):
    """Bad numbers named the CLI's flag ("learning_rate is required") or nothing at all (gradio's own
    "Value -1 is less than minimum value 1." with a 27-line traceback in the log); a Start refused
    while a run went on showed a toast under a line that still said "Started run …"."""
    page = open_page()
    login(page)
    action, command = page.locator("#train-action"), page.locator("#train-command")
    rate, epochs = (page.get_by_role("spinbutton", name=name) for name in ("Learning rate", "Epochs"))
    rate.fill("")
    rate.press("Tab")
    page.locator("#train-start").click()
    expect(action).to_contain_text("Cannot start a run: Learning rate is required")
    rate.fill("0.001")
    epochs.fill("-1")
    epochs.press("Tab")
    page.locator("#train-start").click()
    expect(action).to_contain_text("Cannot start a run: Epochs must be >= 1, got -1")
    page.locator("#train-show-command").click()
    expect(command).to_contain_text("# no command: Epochs must be >= 1, got -1")
    page.first_screen("12-refused-start")
    assert "Traceback" not in capfd.readouterr().err
    if page.size == "phone":
        return  # one real run is enough: the line is the same
    epochs.fill("1")
    page.locator("#train-more").get_by_text("More settings").click()
    for elem_id, value in (("train-n-train", 64), ("train-n-val", 8), ("train-beams", 1)):
        page.locator(f"#{elem_id} input").fill(str(value))
    page.locator("#train-start").click()
    expect(action).to_contain_text("Started run")
    run_id = served.tab.manager.runs()[0]
    try:
        page.locator("#train-start").click()  # a second run while the first goes on: refused, and said so
        expect(action).to_contain_text(f"Cannot start a run: run {run_id} is still running")
        expect(action).not_to_contain_text("Started run")
    finally:
        served.tab.manager.stop(run_id)
        deadline = time.monotonic() + 120
        while served.tab.manager.status(run_id).state in ("running", "stopping"):
            assert time.monotonic() < deadline, served.tab.manager.status(run_id)
            time.sleep(1)


# --------------------------------------------------------------------------- item 13: a swap, a restart


def load_model(page, option: str) -> None:
    """A logged-in trainer's Load in the Chat tab's model picker (``option``: the start of its label)."""
    page.get_by_role("tab", name="Chat").click()
    if not page.locator("#model-picker input").is_visible():
        page.get_by_role("button", name=re.compile("^Model")).click()  # the accordion
    page.locator("#model-picker input").click()
    page.get_by_role("option", name=option).click()
    page.locator("#model-load").click()
    expect(page.locator("#model-load-note")).to_contain_text(f"Now serving {option}", timeout=60_000)


def test_a_swap_on_another_page_is_said_in_the_chat_and_the_picker_follows(open_page, served):
    a, b = open_page("a"), open_page("b")
    first = send(b, "hi! who are you?")  # page B's chat, on the demo model
    login(a)
    try:
        load_model(a, "second/final")
        box = b.get_by_role("textbox", name="Message")
        box.fill("and what do you do?")
        box.press("Enter")
        expect(bot_messages(b)).to_have_count(3)  # the reply, and the note after it
        expect(b.locator("#chat-input button.stop-button")).to_have_count(0)
        # page B's conversation changed model: a note after the first reply of the new one says so
        note = b.locator("#chat-log").get_by_text("The model changed: now second/final")
        expect(note).to_be_visible()
        expect(bot_messages(b).first).to_have_text(first)
        b.get_by_role("button", name=re.compile("^Model")).click()  # its picker names the new model
        expect(b.locator("#model-picker input")).to_have_value(re.compile(r"^second/final"))
        b.shot("13-model-changed")
        load_model(a, "demo model")  # back, on page A; page B's picker follows when its Chat tab opens
        b.get_by_role("tab", name="Compare").click()
        b.get_by_role("tab", name="Chat").click()
        expect(b.locator("#model-picker input")).to_have_value(re.compile(r"^demo model"))
    finally:
        if served.engine.current.name != str(DEMO_DIR):
            served.engine.swap(str(DEMO_DIR))


@pytest.mark.parametrize("size", ["desktop"])
def test_a_restart_keeps_saved_chats_and_the_served_model_and_says_the_login_ended(
    size, browser, tmp_path, monkeypatch, shots
):
    """After a restart the saved chats and the login vanished silently (gradio made a new key for
    browser storage at each start) and the demo model served again."""
    monkeypatch.setenv("PERSONA_CHAT_STATE", str(tmp_path / "state"))
    port, root, config = free_port(), tmp_path / "app", auth.AuthConfig(password=PASSWORD)
    served = App(root, config, port=port, as_started=True)
    shutil.copytree(DEMO_DIR, served.runs / "second" / "final")
    context = browser.new_context(viewport=VIEWPORTS[size])
    try:
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.goto(served.url)
        reply = send(page, "hello from before the restart")
        expect(page.get_by_role("gridcell")).to_have_count(1)
        login(page)
        load_model(page, "second/final")
        served.close()
        # A new process: the same address (the same browser storage), no live logins.
        served = App(root, auth.AuthConfig(password=PASSWORD), port=port, as_started=True)
        assert served.engine.current.name == str(served.runs / "second" / "final")
        page.reload()
        expect(page.locator("#serving-status")).to_contain_text("Serving second/final")
        saved = page.get_by_role("gridcell", name="hello from before the restart")
        expect(saved).to_be_visible()
        saved.click()
        expect(bot_messages(page)).to_have_text([reply])
        page.get_by_role("tab", name="Train").click()
        expect(page.locator("#train-auth")).to_contain_text("Your login has ended")
        page.screenshot(path=shots / f"journey-13-after-restart-{size}.png")
    finally:
        context.close()
        served.close()
