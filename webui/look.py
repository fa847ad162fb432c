"""The app's look: the theme, the style sheet and the page's script (``app.py`` gives them to
``gr.Blocks``: Spaces and ``gradio app.py`` launch without arguments).

Measured in the browser (tests/webui/test_browser_chat.py, test_browser_journeys.py): text meets
WCAG AA (4.5:1), controls and focus rings 3:1, on the light theme.
"""

from __future__ import annotations

import gradio as gr

# WCAG AA (4.5:1) for small text: gradio's default orange primary button (white on orange-500)
# and subdued help text (gray-400 on white) fall short; a darker orange and gray-600 pass.
THEME = gr.themes.Default().set(
    body_text_color_subdued="*neutral_600",
    body_text_color_subdued_dark="*neutral_400",
    button_primary_background_fill="*primary_700",
    button_primary_background_fill_hover="*primary_800",
    button_primary_background_fill_dark="*primary_700",
    button_primary_background_fill_hover_dark="*primary_800",
    button_primary_text_color="white",
    button_primary_text_color_dark="white",
)

# On a phone the chat fits the first screen: a shorter chat log, and the saved chats under it; the
# Compare tab's two panes are short enough that the message box is on the first screen too.
# Texts never scroll: gradio's block is overflow:auto, and a fraction of a pixel too much (the
# serving banner's line) makes Chromium give it a Tab stop, as a keyboard-focusable scroller.
# The serving banner is an output of every reply: no progress overlay over it while the bot writes.
# Focus rings (WCAG 2.4.7): gradio draws none on the message box and a thin one elsewhere; this one
# is the primary button's orange-700, over 3:1 against both the light and the dark background.
CSS = """
@media (max-width: 640px) {
  #chat-log { height: 52vh !important; max-height: 52vh !important; }
  #chat-log .examples { padding: var(--spacing-lg); gap: var(--spacing-md); }
  #chat-log .example { padding: var(--spacing-md) var(--spacing-lg); }
  #chat-log .example-text-content { margin-top: 0; }
  #chat-column .row:has(#chat-log) > .column:first-child { order: 2; }
  #compare-a, #compare-b { height: 28vh !important; max-height: 28vh !important; }
}
.block:has(> [data-testid="markdown-wrapper"]) { overflow: visible !important; }
#serving-status > [data-testid="status-tracker"] { display: none !important; }
#chat-column :is(textarea, button, [role="gridcell"]):focus-visible, [role="tab"]:focus-visible {
  outline: 3px solid var(--button-primary-background-fill) !important;
  outline-offset: 1px;
}
"""

# The page's script, three parts, rerun on every change of the page (gradio redraws parts of it):
# - After each reply the message box takes the focus back: while the bot writes, gradio disables
#   the box (or shows its stop button) and the focus falls to the page. When the reply is over and
#   nothing else has the focus, the box gets it again.
# - Names for gradio's icon-only buttons that have none (send, stop, share), and the trash button
#   says what it does with save_history: it deletes the saved chat.
# - The tabs, the saved chats and the examples are each one Tab stop, moved in with the arrow
#   keys (WAI-ARIA's roving tabindex), so the message box is the 4th Tab stop of a fresh page (5th
#   with saved chats), not the 13th.
JS = """
() => {
  const NAMES = [
    ["#chat-input .submit-button", "Send message"],
    ["#chat-input .stop-button", "Stop the reply"],
    ["#chat-log .top-panel button.icon-button[aria-label='']", "Share"],
    ["#chat-log .top-panel button.icon-button[aria-label='Clear']", "Delete this chat"],
  ];
  // [group, its items, the role it gets and its name]: each group is one Tab stop.
  const GROUPS = [
    ["[role='tablist']", ":scope > button[role='tab']"],
    ["#chat-column table[role='grid']", "td[role='gridcell']"],
    ["#chat-log .examples", ":scope > button.example", "toolbar", "Example messages"],
  ];
  const last = new WeakMap();  // group -> the item focused last
  const items = (group, selector) => [...group.querySelectorAll(selector)].filter(i => !i.disabled);
  const selected = item => item.closest("[aria-selected='true']") !== null;
  function tidy() {
    for (const [selector, name] of NAMES) {
      for (const button of document.querySelectorAll(selector)) {
        // Only when it differs: setting an attribute, even to its value, wakes the observer below.
        if (button.getAttribute("aria-label") !== name) button.setAttribute("aria-label", name);
        if (button.getAttribute("title") !== name) button.setAttribute("title", name);
      }
    }
    for (const img of document.querySelectorAll("#chat-column button img[alt]:not([alt=''])")) img.alt = "";
    for (const [selector, itemSelector, role, name] of GROUPS) {
      for (const group of document.querySelectorAll(selector)) {
        if (role && group.getAttribute("role") !== role) {
          group.setAttribute("role", role);
          group.setAttribute("aria-label", name);
        }
        const all = items(group, itemSelector);
        const stop = all.find(selected) || (all.includes(last.get(group)) && last.get(group)) || all[0];
        for (const item of all) {
          const index = item === stop ? "0" : "-1";
          if (item.getAttribute("tabindex") !== index) item.setAttribute("tabindex", index);
        }
      }
    }
  }
  const STEPS = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1, Home: "first", End: "last" };
  document.addEventListener("keydown", event => {
    if (!(event.key in STEPS) || event.altKey || event.ctrlKey || event.metaKey) return;
    for (const [selector, itemSelector] of GROUPS) {
      const group = event.target.closest(selector);
      const all = group ? items(group, itemSelector) : [];
      const at = all.indexOf(event.target);
      if (at < 0) continue;
      const step = STEPS[event.key];
      const next = all[step === "first" ? 0 : step === "last" ? all.length - 1 : (at + step + all.length) % all.length];
      event.preventDefault();
      last.set(group, next);
      next.focus();
      return;
    }
  }, true);
  document.addEventListener("focusin", event => {
    for (const [selector, itemSelector] of GROUPS) {
      const group = event.target.closest(selector);
      if (group && items(group, itemSelector).includes(event.target)) last.set(group, event.target);
    }
  });
  let busy = false;
  new MutationObserver(() => {
    tidy();
    const box = document.querySelector("#chat-input textarea");
    if (!box) return;
    const now = box.disabled || !!document.querySelector("#chat-input .stop-button");
    const idle = !document.activeElement || document.activeElement === document.body;
    if (busy && !now && idle) box.focus();
    busy = now;
  }).observe(document.body, {
    subtree: true, childList: true, attributes: true, attributeFilter: ["disabled", "aria-selected", "aria-label"],
  });
  tidy();
}
"""
