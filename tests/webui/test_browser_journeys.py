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
from playwright.sync_api import Error as PlaywrightError
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


@pytest.fixture(scope="module", autouse=True)
def _patient():
    """Replies, saves and loads on a shared 2-core machine can outlast expect's 5 s default."""
    expect.set_options(timeout=20_000)
    yield
    expect.set_options(timeout=5_000)


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


def reopen(page, url: str) -> None:
    """The page again after a restart (gradio's own script may navigate at the same moment: retried)."""
    for attempt in range(3):
        try:
            page.goto(url)
            break
        except PlaywrightError:
            if attempt == 2:
                raise
            page.wait_for_timeout(1000)
    expect(page.locator("#chat-input textarea")).to_be_visible()


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


def test_choosing_models_without_a_login_says_why_under_the_button(open_page):
    """Every refusal of the app shows on the page: the Chat tab's Load (test_browser_train.py) and
    Compare's model choice say why under their button."""
    page = open_page()
    page.get_by_role("tab", name="Compare").click()
    page.get_by_role("button", name="Models").click()  # the accordion
    page.locator("#compare-load").click()
    expect(page.locator("#compare-load-note")).to_contain_text("Cannot choose the models to compare: log in first")
    assert not page.locator("#compare-load-note .wrap.error, .toast-body.error").count()


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
        reopen(page, served.url)
        expect(page.locator("#serving-status")).to_contain_text("Serving second/final")
        saved = page.get_by_role("gridcell", name="hello from before the restart")
        expect(saved).to_be_visible()
        saved.click()
        expect(bot_messages(page)).to_have_text([reply])
        page.get_by_role("tab", name="Train").click()
        expect(page.locator("#train-auth")).to_contain_text("Your login has ended")
        page.screenshot(path=shots / f"journey-13-after-restart-{size}.png")
        expect(page.locator("#browser-key-changed")).to_have_count(0)  # the same key: nothing lost
        # The key lost (a Space's disk reset without PERSONA_CHAT_BROWSER_KEY): the chats cannot be read,
        # and the page says so rather than showing none silently.
        served.close()
        monkeypatch.setenv("PERSONA_CHAT_STATE", str(tmp_path / "a-new-state"))
        served = App(root, auth.AuthConfig(password=PASSWORD), port=port, as_started=True)
        reopen(page, served.url)
        expect(page.locator("#browser-key-changed")).to_contain_text("can no longer be read")
        expect(page.get_by_role("gridcell")).to_have_count(0)
        page.screenshot(path=shots / f"journey-13-key-lost-{size}.png")
    finally:
        context.close()
        served.close()


# --------------------------------------------------------------------------- item 10: the first screen


def bottom(page, selector: str) -> float:
    box = page.locator(selector).first.bounding_box()
    assert box is not None, f"{selector} is not shown"
    return box["y"] + box["height"]


def test_the_message_box_and_who_the_bot_is_are_on_the_first_screen(open_page):
    """On a phone the message box started at y=845 of an 844 px screen, the kind picker at ~1,098 px,
    Compare's message box at ~1,340 px."""
    page = open_page()
    height = page.viewport_size["height"]
    shown = {name: bottom(page, selector) for name, selector in FIRST_SCREEN["Chat"].items()}
    page.first_screen("10-chat-first-screen")
    assert all(y <= height for y in shown.values()), shown
    assert bottom(page, "#chat-input textarea") < page.locator("#chat-kind").bounding_box()["y"] or page.size != "phone"
    page.get_by_role("tab", name="Compare").click()
    expect(page.locator("#compare-input textarea")).to_be_visible()
    shown = {name: bottom(page, selector) for name, selector in FIRST_SCREEN["Compare"].items()}
    page.first_screen("10-compare-first-screen")
    assert all(y <= height for y in shown.values()), shown
    if page.size == "desktop":  # the replies and the vote too
        assert bottom(page, "#compare-votes") <= height


FIRST_SCREEN = {
    "Chat": {"message box": "#chat-input textarea", "kind": "#chat-kind", "context": "#chat-context"},
    "Compare": {"message box": "#compare-input textarea", "kind": "#compare-kind", "context": "#compare-context"},
}


# --------------------------------------------------------------------------- item 11: keyboard, contrast


def luminance(css_color: str) -> float:
    """WCAG relative luminance of a computed ``rgb()``/``rgba()`` colour."""
    r, g, b = (int(float(v)) / 255 for v in re.findall(r"[\d.]+", css_color)[:3])

    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b)


def contrast(foreground: str, background: str) -> float:
    lighter, darker = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


# [text colour, the first opaque background behind it, the element's opacity times its ancestors'].
COLORS_JS = """
element => {
  let node = element, background = "rgb(255, 255, 255)", opacity = 1;
  for (let up = element; up && up.nodeType === 1; up = up.parentElement) {
    opacity *= parseFloat(getComputedStyle(up).opacity);
  }
  while (node && node.nodeType === 1) {
    const fill = getComputedStyle(node).backgroundColor;
    if (fill && fill !== "transparent" && !/rgba\\(.*, 0\\)$/.test(fill)) { background = fill; break; }
    node = node.parentElement;
  }
  return [getComputedStyle(element).color, background, opacity];
}
"""
RING_JS = (
    """e => { const s = getComputedStyle(e); return [s.outlineStyle, parseFloat(s.outlineWidth), s.outlineColor]; }"""
)


def ratio(locator) -> float:
    foreground, background, opacity = locator.evaluate(COLORS_JS)
    assert opacity == 1, f"drawn at opacity {opacity}"  # a faded colour is not the computed one
    return round(contrast(foreground, background), 2)


def ring(locator) -> tuple[str, float, float]:
    """(outline style, width, contrast of its colour against the background behind the element)."""
    style, width, color = locator.evaluate(RING_JS)
    _, background, _ = locator.evaluate(COLORS_JS)
    return style, width, round(contrast(color, background), 2)


# Every emoji in the page's text stands next to a word: no status, hint or label is an emoji alone.
EMOJI_JS = r"""() => {
  const text = document.body.innerText, lonely = [];
  for (const m of text.matchAll(/\p{Extended_Pictographic}\uFE0F?/gu)) {
    const after = text.slice(m.index + m[0].length).replace(/^[\s\uFE0F]+/u, "");
    if (!/^[\p{L}\p{N}"'(*]/u.test(after)) lonely.push(text.slice(Math.max(0, m.index - 20), m.index + 20));
  }
  return lonely;
}"""


def test_keyboard_focus_and_contrast(open_page):
    """Focus was invisible on a checked radio and near-white on the context box; kind and preset took
    7 Tab stops; the selected tab label was 2.8:1, the Show command box 1.56-2.84:1, Stop 3.76:1;
    disabled buttons looked half-enabled; some hints were emoji alone."""
    page = open_page()
    # -- one Tab stop per radio group, the arrow keys choose (the browser's own radio group)
    context = page.locator("#chat-context textarea")
    context.click()
    page.keyboard.press("Shift+Tab")
    persona = page.get_by_role("radio", name="Persona")
    expect(persona).to_be_focused()
    style, width, seen = ring(page.locator("#chat-kind label").filter(has=persona))
    assert style != "none" and width >= 2 and seen >= 3, (style, width, seen)  # the checked radio's ring
    page.keyboard.press("Tab")
    expect(context).to_be_focused()
    style, width, seen = ring(context)
    assert style != "none" and width >= 2 and seen >= 3, (style, width, seen)  # not near-white
    page.keyboard.press("Tab")
    expect(page.get_by_role("radio", name=re.compile("^Fast"))).to_be_focused()  # the whole kind group was one stop
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.type") != "radio"  # and the preset group one
    page.first_screen("11-focus-ring")
    persona.focus()
    page.keyboard.press("ArrowRight")
    expect(page.get_by_role("radio", name="Emotion")).to_be_checked()
    expect(page.locator("#context-emotion input")).to_have_value("joyful")  # the kind's own events ran
    # -- contrast, as the browser computed the colours
    ratios = {"selected tab": ratio(page.locator("[role='tab'][aria-selected='true']").first)}
    ratios["selected tab's line"] = round(
        contrast(
            page.evaluate(
                "() => getComputedStyle(document.querySelector(\"[role='tab'][aria-selected='true']\"), '::after')"
                ".backgroundColor"
            ),
            "rgb(255, 255, 255)",
        ),
        2,
    )
    page.get_by_role("tab", name="Train").click()
    disabled, enabled = page.locator("#train-start"), page.locator("#train-show-command")
    expect(disabled).to_be_disabled()
    looks = disabled.evaluate(
        "e => [getComputedStyle(e).opacity, getComputedStyle(e).borderStyle, getComputedStyle(e).cursor]"
    )
    assert looks == ["1", "dashed", "not-allowed"], looks  # not the enabled colours at half opacity
    background = disabled.evaluate(COLORS_JS)[1]
    assert len(set(re.findall(r"\d+", background)[:3])) <= 2, background  # a gray, not the primary orange
    ratios["disabled Start"] = ratio(disabled)
    page.locator("#train-show-command").click()
    expect(page.locator("#train-command")).to_contain_text("--model_name_or_path")
    for token in page.locator("#train-command .cm-line, #train-command .cm-line span").all():
        if token.inner_text().strip():
            ratios[f"command {token.inner_text().strip()[:20]}"] = ratio(token)
    page.shot("11-train-unlocked-look")
    login(page)
    expect(page.locator("#train-start")).to_be_enabled()
    page.wait_for_timeout(1000)  # (gradio's buttons fade to their new colours)
    ratios["Stop"] = ratio(page.locator("#train-stop"))
    ratios["Start"] = ratio(page.locator("#train-start"))
    ratios["Show command"] = ratio(enabled)
    low = {name: value for name, value in ratios.items() if value < (3 if "line" in name else 4.5)}
    assert not low, low
    # -- no status, hint or label is an emoji alone (where no emoji font draws them, nothing is left)
    for tab in ("Train", "Compare", "Chat"):
        page.get_by_role("tab", name=tab).click()
        page.wait_for_timeout(500)
        assert not page.evaluate(EMOJI_JS), (tab, page.evaluate(EMOJI_JS))


# --------------------------------------------------------------------------- item 15


def test_the_win_rate_table_fits_a_phone(open_page, served):
    store = served.tab.feedback_store()
    runs = [str(served.runs / "20261203-094857-daf2d8" / "final"), str(DEMO_DIR)]
    store.vote(model_a=runs[0], model_b=runs[1], winner="a", visitor=store.visitor_key("198.51.100.7"))
    page = open_page()
    page.get_by_role("tab", name="Compare").click()
    table = page.locator("#compare-table")
    expect(table.locator("[role=gridcell][data-col='0']").first).to_be_visible()
    width = page.viewport_size["width"]
    sizes = table.evaluate(
        """t => {
          const grid = t.querySelector('table'), cells = [...grid.querySelectorAll('th, td')];
          return [grid.scrollWidth, grid.parentElement.clientWidth, ...cells.map(c => c.getBoundingClientRect().right)];
        }"""
    )
    table.scroll_into_view_if_needed()
    page.first_screen("15-win-rates")
    scroll, shown, *rights = sizes
    assert scroll <= shown + 1 and max(rights) <= width, sizes  # nothing cut, nothing to scroll sideways
    expect(table).to_contain_text("Win rate")


def test_export_says_what_it_did(open_page, served):
    store = served.tab.feedback_store()
    for i, status in enumerate(("accepted", "pending")):
        store.add(
            kind="none", context="", turns=[f"hi {i}"], response=f"hello there {i}!", rating="correction",
            visitor="trainer:password", status=status,
        )  # fmt: skip
    page = open_page()
    login(page)
    page.locator("#review").get_by_text(re.compile(r"^Feedback from the chat")).click()
    page.locator("#review-rows [role=gridcell][data-row='0'][data-col='1']").click()
    page.locator("#review-reject").click()
    note = page.locator("#review-note")
    expect(note).to_contain_text("rejected.")
    with page.expect_download() as saved:  # the rows reach the browser, which saves them (no served file)
        page.locator("#review-export").click()
    accepted = store.counts()["accepted"]
    expect(note).to_contain_text(f"Exported {accepted} accepted row")  # not "Row 7: rejected." any more
    expect(note).to_contain_text(saved.value.suggested_filename)
    page.locator("#review").scroll_into_view_if_needed()
    page.first_screen("15-export-note")


def test_after_a_reload_no_saved_chat_looks_open(open_page):
    page = open_page()
    send(page, "a chat to keep")
    cells = page.get_by_role("gridcell")
    expect(cells).to_have_count(1)
    rows = page.locator("#chat-column table[role='grid'] tbody tr")
    expect(rows.first).to_have_attribute("aria-current", "true")  # the chat on the page is that one
    page.reload()
    expect(page.locator("#chat-input textarea")).to_be_visible(timeout=30_000)
    expect(cells).to_have_count(1)
    expect(bot_messages(page)).to_have_count(0)  # a new, empty chat
    assert rows.first.get_attribute("aria-current") is None
    backgrounds = rows.first.locator("td").evaluate(
        "c => [getComputedStyle(c).backgroundColor, getComputedStyle(c.closest('tr')).backgroundColor]"
    )
    assert all(b in ("rgba(0, 0, 0, 0)", "transparent") for b in backgrounds), backgrounds  # no stripe, no mark
    page.first_screen("15-reload")
    cells.first.click()
    expect(rows.first).to_have_attribute("aria-current", "true")
    expect(page.locator("[data-testid='user']")).to_have_text(["a chat to keep"])


# --------------------------------------------------------------------------- the README's pictures


def test_a_chat_and_a_comparison_at_both_sizes(open_page, served):
    """The journeys end to end at both sizes, the first screen kept as the README's pictures
    (docs/images/chat-<size>.png, compare-<size>.png are copies of these screenshots)."""
    page = open_page()
    page.get_by_role("textbox", name="Persona").fill("I am a lighthouse keeper who collects blue seashells.")
    send(page, "hi! who are you?")
    send(page, "what do you do on weekends?")
    expect(page.get_by_role("gridcell")).to_have_count(1)  # saved: the chat's events are over
    page.wait_for_timeout(1000)
    page.evaluate("() => window.scrollTo(0, 0)")
    page.first_screen("readme-chat")
    assert bottom(page, "#chat-input textarea") <= page.viewport_size["height"]
    login(page)
    page.get_by_role("tab", name="Compare").click()
    page.get_by_role("button", name="Models").click()  # the accordion
    page.locator("#compare-model-b input").click()
    page.get_by_role("option", name="second/final").click()
    page.locator("#compare-load").click()
    expect(page.locator("#compare-pair")).to_contain_text("B**: second/final".replace("**", ""))
    page.get_by_role("button", name="Models").click()  # closed again
    page.locator("#compare-input textarea").fill("hi! what do you like to do?")
    page.locator("#compare-send").click()
    expect(page.locator("#compare-vote-b")).to_be_enabled()
    for side in "ab":
        expect(bot_messages(page, f"#compare-{side}")).to_have_count(1)
    page.locator("#compare-vote-b").click()
    expect(page.locator("#compare-note")).to_contain_text("your vote is saved: B is better")
    page.evaluate("() => window.scrollTo(0, 0)")
    page.first_screen("readme-compare")
    assert bottom(page, "#compare-input textarea") <= page.viewport_size["height"]
