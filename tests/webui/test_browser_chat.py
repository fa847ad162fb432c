"""The Chat tab's first ten minutes in a real browser (headless Debian chromium through Playwright),
on a desktop (1366x900) and on a phone (390x844): each kind keeps its own context, examples are
labelled and send themselves, the chat comes first on a phone, the message box has a name and
gets the focus back after each reply, help text and the primary button meet WCAG AA contrast,
New chat resets the token meter, the message box is the 4th Tab stop with a visible focus ring, and
every button in the chat has a name.

Every test keeps screenshots: in ``$PERSONA_CHAT_SCREENSHOTS`` if set, else in a pytest temporary
folder; the folder is printed at the end of the run.
"""

from __future__ import annotations

import re

import pytest
from browser import VIEWPORTS, expect, needs_browser, screenshot_folder, shout
from served_app import App

from webui import auth, chat_handlers, chat_tab

pytestmark = needs_browser

AA = 4.5  # WCAG AA contrast for normal-size text


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    app = App(tmp_path_factory.mktemp("browser-chat"), auth.AuthConfig(password="browser-chat-password"))
    yield app
    app.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = screenshot_folder(tmp_path_factory, "screenshots")
    yield folder
    shout(request, f"chat browser screenshots: {folder}")


@pytest.fixture(params=list(VIEWPORTS))
def page(request, served, browser, shots):
    """A fresh page (its own local storage) at the desktop or phone size."""
    context = browser.new_context(viewport=VIEWPORTS[request.param])
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(served.url)
    expect(page.locator("#chat-input textarea")).to_be_visible()
    page.shot = lambda name: page.screenshot(path=shots / f"{name}-{request.param}.png", full_page=True)
    page.shots, page.size = shots, request.param
    yield page
    context.close()


def bot_messages(page):
    return page.locator("[data-testid='bot']")


def wait_for_reply(page, count: int) -> str:
    expect(bot_messages(page)).to_have_count(count)
    expect(page.locator("button.stop-button")).to_have_count(0)  # streaming is over
    reply = bot_messages(page).last.inner_text().strip()
    assert reply and "Nothing was sent to the model" not in reply
    return reply


def send(page, text: str) -> str:
    before = bot_messages(page).count()
    box = page.get_by_role("textbox", name="Message")
    box.fill(text)
    box.press("Enter")
    return wait_for_reply(page, before + 1)


# --------------------------------------------------------------------------- colours


def luminance(css_color: str) -> float:
    """WCAG relative luminance of a computed ``rgb()``/``rgba()`` colour."""
    r, g, b = (int(v) / 255 for v in re.findall(r"[\d.]+", css_color)[:3])

    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b)


def contrast(foreground: str, background: str) -> float:
    lighter, darker = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


# The text colour and the first opaque background behind the element, as the browser computed them.
COLORS_JS = """
element => {
  let node = element, background = "rgb(255, 255, 255)";
  while (node && node.nodeType === 1) {
    const fill = getComputedStyle(node).backgroundColor;
    if (fill && fill !== "transparent" && !/rgba\\(.*, 0\\)$/.test(fill)) { background = fill; break; }
    node = node.parentElement;
  }
  return [getComputedStyle(element).color, background];
}
"""


def test_luminance_and_contrast_follow_wcag():
    assert contrast("rgb(0, 0, 0)", "rgb(255, 255, 255)") == pytest.approx(21)
    assert contrast("rgb(156, 163, 175)", "rgb(255, 255, 255)") < AA  # gradio's default subdued gray-400


# --------------------------------------------------------------------------- the tests


def test_each_kind_keeps_its_own_context(page):
    persona = page.get_by_role("textbox", name="Persona")
    persona.fill("I am a chef who loves spicy food.")
    page.get_by_role("radio", name="Topic").check()
    topic = page.get_by_role("textbox", name="Topic")
    expect(topic).to_have_value(chat_handlers.KIND_DEFAULTS["topic"])  # not the persona sentence
    topic.fill("the blues")
    page.shot("1-topic")
    page.get_by_role("radio", name="Persona").check()
    expect(page.get_by_role("textbox", name="Persona")).to_have_value("I am a chef who loves spicy food.")
    page.get_by_role("radio", name="Emotion").check()
    expect(page.locator("#context-emotion input")).to_have_value("joyful")
    page.get_by_role("radio", name="Topic").check()
    expect(page.get_by_role("textbox", name="Topic")).to_have_value("the blues")
    # the chat gets the box's context: a reply to the topic the user typed
    send(page, "what do you like?")
    page.get_by_role("radio", name="Persona").check()
    expect(page.get_by_role("textbox", name="Persona")).to_have_value("I am a chef who loves spicy food.")
    page.shot("1-persona-restored")


def test_examples_are_labelled_and_send_themselves(page):
    for label in chat_handlers.EXAMPLE_LABELS:
        expect(page.get_by_role("button", name=label)).to_be_visible()
    page.shot("2-examples")
    page.get_by_role("button", name="Emotion: I just got some great news!").click()
    wait_for_reply(page, 1)
    expect(page.locator("[data-testid='user']").last).to_contain_text("I just got some great news!")
    expect(page.get_by_role("radio", name="Emotion")).to_be_checked()
    expect(page.locator("#context-emotion input")).to_have_value("joyful")
    page.shot("2-example-sent")


def test_the_chat_comes_first_and_fits_the_first_screen(page):
    height = page.viewport_size["height"]
    expect(page.get_by_text(chat_tab.PLACEHOLDER)).to_be_attached()
    assert "on the left" not in page.locator("#chat-log").inner_text()
    box = page.locator("#chat-input textarea").bounding_box()
    assert box["y"] + box["height"] <= height, f"the message box ends at {box['y'] + box['height']} px"
    kind = page.locator("#chat-kind").bounding_box()
    if page.viewport_size["width"] < 640:  # stacked: the chat, then who the bot is (on the first screen too)
        assert box["y"] < kind["y"] and kind["y"] + kind["height"] <= height, (box, kind)
    page.shot("3-first-screen")


def test_message_box_is_named_and_gets_the_focus_back(page):
    box = page.get_by_role("textbox", name="Message")
    expect(box).to_have_count(1)
    send(page, "hi! who are you?")
    expect(page.locator("#chat-input textarea")).to_be_focused()
    page.shot("4-focus-after-reply")


def test_help_text_and_primary_button_meet_wcag_aa(page):
    checks = {
        "help text": page.get_by_text(chat_handlers.CONTEXT_LABELS["persona"][1]),
        "New chat": page.get_by_role("button", name="New chat"),
    }
    ratios = {}
    for name, element in checks.items():
        foreground, background = element.first.evaluate(COLORS_JS)
        ratios[name] = round(contrast(foreground, background), 2)
    page.shot("4-contrast")
    assert all(ratio >= AA for ratio in ratios.values()), ratios


def test_new_chat_resets_the_token_meter(page):
    meter = page.locator("#token-meter")
    initial = chat_handlers.meter_text(None)
    expect(meter).to_have_text(initial)
    send(page, "hello there!")
    expect(meter).to_contain_text("tokens;")
    page.shot("5-meter-after-reply")
    page.get_by_role("button", name="New chat").click()
    expect(meter).to_have_text(initial)
    expect(bot_messages(page)).to_have_count(0)
    page.shot("5-new-chat")


# --------------------------------------------------------------------------- keyboard and screen readers

# What has the focus: "box" for the message box, else the element's role or tag and its name.
FOCUSED_JS = """() => {
  const e = document.activeElement;
  if (!e || e === document.body) return "page";
  if (e.closest("#chat-input") && e.tagName === "TEXTAREA") return "box";
  const name = e.getAttribute("aria-label") || e.innerText || "";
  return `${e.getAttribute("role") || e.tagName.toLowerCase()} ${name}`.trim();
}"""


def tab_stops_to_the_message_box(page, limit: int = 12) -> list[str]:
    """What each Tab press from the top of the page focuses, up to the message box (or ``limit`` presses)."""
    page.evaluate("() => document.activeElement?.blur()")
    stops = []
    while len(stops) < limit and stops[-1:] != ["box"]:
        page.keyboard.press("Tab")
        stops.append(page.evaluate(FOCUSED_JS)[:40])
    return stops


def test_the_message_box_is_an_early_tab_stop_with_a_visible_focus_ring(page):
    stops = tab_stops_to_the_message_box(page)
    assert stops[-1] == "box" and len(stops) <= 4, stops  # the Chat tab, New chat, the examples, the box (was 10th)
    box = page.locator("#chat-input textarea")
    style, width, color = box.evaluate(
        "e => [getComputedStyle(e).outlineStyle, parseFloat(getComputedStyle(e).outlineWidth), "
        "getComputedStyle(e).outlineColor]"
    )
    _, background = box.evaluate(COLORS_JS)
    assert style != "none" and width >= 2, (style, width)
    assert contrast(color, background) >= 3, (color, background)  # WCAG 1.4.11 for a focus indicator
    page.screenshot(path=page.shots / f"6-focus-ring-{page.size}.png")  # (a phone lays #chat-column out flat)
    # The examples are one Tab stop: the arrow keys move between them and Enter sends one.
    box.press("Shift+Tab")
    first = page.get_by_role("button", name=chat_handlers.EXAMPLE_LABELS[0])
    expect(first).to_be_focused()
    expect(page.get_by_role("toolbar", name="Example messages")).to_be_visible()
    page.keyboard.press("ArrowRight")
    expect(page.get_by_role("button", name=chat_handlers.EXAMPLE_LABELS[1])).to_be_focused()
    page.keyboard.press("End")
    expect(page.get_by_role("button", name=chat_handlers.EXAMPLE_LABELS[-1])).to_be_focused()
    page.keyboard.press("Enter")
    wait_for_reply(page, 1)
    expect(page.get_by_role("radio", name="None")).to_be_checked()
    # With saved chats (after a reload, local storage keeps them): one more stop, the list.
    send(page, "and what else?")
    expect(page.get_by_role("gridcell")).to_have_count(1)  # saved (the example's reply alone is not)
    page.reload()
    expect(page.locator("#chat-input textarea")).to_be_visible()
    expect(page.get_by_role("gridcell")).to_have_count(1)
    stops = tab_stops_to_the_message_box(page)
    assert stops[-1] == "box" and len(stops) <= 5, stops
    page.shot("6-keyboard-with-a-saved-chat")


def test_every_button_in_the_chat_has_a_name(page):
    # The stop button shows while the bot writes: note its name whenever the page changes.
    page.evaluate(
        """() => { window.stopNames = [];
          new MutationObserver(() => { const b = document.querySelector('#chat-input .stop-button');
            if (b) window.stopNames.push(b.getAttribute('aria-label')); })
          .observe(document.body, { subtree: true, childList: true, attributes: true }); }"""
    )
    send(page, "hi! who are you?")
    send(page, "what do you do for fun?")
    assert "Stop the reply" in page.evaluate("() => window.stopNames")
    bot_messages(page).last.hover()
    page.shot("7-buttons-named")
    tree = page.locator("#chat-column").aria_snapshot()
    buttons = re.findall(r'^\s*- button(?: "([^"]*)")?', tree, re.MULTILINE)
    assert buttons and all(name and name.strip() for name in buttons), tree
    for name in ("Send message", "Delete this chat", "Share", "Copy conversation", "Retry", "Undo", "Edit", "Like"):
        assert name in buttons, (name, buttons)
    assert "New chat" in buttons  # the icon is decorative: not "New chat icon New chat"
    # An icon button's name is also its tooltip.
    expect(page.locator("#chat-input .submit-button")).to_have_attribute("title", "Send message")
