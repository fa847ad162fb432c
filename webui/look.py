"""The app's look: the theme, the style sheet and the page's script (``app.py`` gives them to
``gr.Blocks``: Spaces and ``gradio app.py`` launch without arguments).

Measured in the browser (tests/webui/test_browser_chat.py, test_browser_journeys.py): text meets
WCAG AA (4.5:1), controls and focus rings 3:1, on the light theme.
"""

from __future__ import annotations

import gradio as gr

RED_700, RED_800 = gr.themes.colors.red.c700, gr.themes.colors.red.c800

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
    # Stop (the "stop" variant): white on red-500 was 3.76:1; red-700 is 6.5:1 (the theme has no
    # CSS variables for its red steps: the colours themselves).
    button_cancel_background_fill=RED_700,
    button_cancel_background_fill_hover=RED_800,
    button_cancel_background_fill_dark=RED_700,
    button_cancel_background_fill_hover_dark=RED_800,
    button_cancel_border_color=RED_700,
    button_cancel_border_color_dark=RED_700,
    button_cancel_text_color="white",
    button_cancel_text_color_dark="white",
)

# On a phone the chat fits the first screen: a shorter chat log, and the saved chats under it; the
# Compare tab's two panes are short enough that the message box is on the first screen too.
# Texts never scroll: gradio's block is overflow:auto, and a fraction of a pixel too much (the
# serving banner's line) makes Chromium give it a Tab stop, as a keyboard-focusable scroller.
# The serving banner is an output of every reply: no progress overlay over it while the bot writes.
# Focus rings (WCAG 2.4.7): gradio draws none on the message box or a checked radio and a near-white
# one on text boxes; this one, on every control (a radio's on its label), is the primary button's
# orange-700, over 3:1 against both the light and the dark background. The selected tab's label was
# orange-500 (2.8:1 on white): orange-700. A disabled button was its enabled colours at half opacity
# (it looked half-enabled): gray with a dashed border.
CSS = """
@media (max-width: 640px) {
  #intro p { display: none; }
  #intro h1 { font-size: var(--text-xxl); margin-bottom: 0; }
  #chat-log { height: 36vh !important; max-height: 36vh !important; }
  #chat-log .examples { padding: var(--spacing-md); gap: var(--spacing-sm); }
  #chat-log .example { padding: var(--spacing-sm) var(--spacing-lg); }
  #chat-log .example-text-content { margin-top: 0; }
  #chat-row { flex-direction: column !important; flex-wrap: nowrap !important; }
  #chat-column, #chat-column > .column, #chat-column .row:has(#chat-log), #bot-settings, #bot-settings > .form {
    display: contents !important;
  }
  #chat-row #bot-settings > *, #chat-row #bot-settings > .form > * { order: 6; }
  #chat-row .row:has(#chat-log) > .column:has(#chat-log) { order: 1; }
  #chat-row #bot-settings #chat-kind { order: 2; }
  #chat-row #bot-settings :is(#chat-context, #context-emotion) { order: 3; }
  #chat-row .row:has(#chat-log) > .column:first-child { order: 4; }
  #chat-row #feedback-note { order: 5; }
  #compare-intro { display: none; }
  #compare-bot, #compare-bot > .form { flex-direction: column !important; }
  #compare-panes, #compare-votes { flex-wrap: nowrap !important; }
  #compare-message-row > *, #compare-panes > *, #compare-votes > * { min-width: 0 !important; }
  #compare-message-row > :not(button) { flex: 1 1 100% !important; }
  #compare-message-row > button { flex: 1 1 40% !important; }
  #compare-panes > *, #compare-votes > * { flex: 1 1 0 !important; }
  #compare-votes > button { white-space: nowrap; padding: var(--spacing-sm); }
  #compare-a, #compare-b { height: 32vh !important; max-height: 32vh !important; }
  #compare-panes :is(.bubble-wrap, .message-wrap) { padding: var(--spacing-xs) !important; }
  #compare-panes .message-row { margin: var(--spacing-xs) 0 !important; padding: 0 !important; }
  #compare-panes .message { padding: var(--spacing-sm) !important; max-width: 100% !important; }
  #compare-table :is(th, td), #compare-table .cell-wrap { padding: 2px !important; min-width: 0 !important; }
  #compare-table .cell-menu-button { display: none !important; }
  #compare-table :is(th, td) * { font-size: var(--text-xs) !important; white-space: normal !important; }
  #compare-table th * { word-break: normal !important; overflow-wrap: normal !important; }
  #compare-table td * { overflow-wrap: anywhere !important; }
}
.block:has(> [data-testid="markdown-wrapper"]) { overflow: visible !important; }
#serving-status > [data-testid="status-tracker"] { display: none !important; }
#chat-column :is(textarea, button, [role="gridcell"]):focus-visible, [role="tab"]:focus-visible {
  outline: 3px solid var(--button-primary-background-fill) !important;
  outline-offset: 1px;
}
:is(input, textarea, select, button, [tabindex]):focus-visible {
  outline: 3px solid var(--button-primary-background-fill) !important;
  outline-offset: 1px;
}
#chat-column table[role="grid"] tr { background: transparent !important; }
#chat-column table[role="grid"] tr[aria-current="true"] td {
  background: var(--primary-100); box-shadow: inset 3px 0 0 var(--button-primary-background-fill); font-weight: 600;
}
label:has(> input:is([type="radio"], [type="checkbox"]):focus-visible) {
  outline: 3px solid var(--button-primary-background-fill) !important;
  outline-offset: 1px;
}
[role="tab"][aria-selected="true"] { color: var(--button-primary-background-fill) !important; }
[role="tab"][aria-selected="true"]::after { background: var(--button-primary-background-fill) !important; }
button:disabled {
  opacity: 1 !important;
  background: var(--neutral-100) !important;
  color: var(--neutral-600) !important;
  border: 1px dashed var(--neutral-400) !important;
  box-shadow: none !important;
  cursor: not-allowed !important;
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
  const selected = item => item.closest("[aria-selected='true'], [aria-current='true']") !== null;
  function tidy() {
    // The saved chat that is open (chat_tab: window.personaChatOpen, its index; none for a new chat).
    const open = window.personaChatOpen;
    document.querySelectorAll("#chat-column table[role='grid'] tbody tr").forEach((row, i) => {
      const current = typeof open === "number" && i === open ? "true" : null;
      if (row.getAttribute("aria-current") !== current) {
        if (current) row.setAttribute("aria-current", current); else row.removeAttribute("aria-current");
      }
    });
    for (const [selector, name] of NAMES) {
      for (const button of document.querySelectorAll(selector)) {
        // Only when it differs: setting an attribute, even to its value, wakes the observer below.
        if (button.getAttribute("aria-label") !== name) button.setAttribute("aria-label", name);
        if (button.getAttribute("title") !== name) button.setAttribute("title", name);
      }
    }
    for (const img of document.querySelectorAll("#chat-column button img[alt]:not([alt=''])")) img.alt = "";
    // gradio names each radio on its own, so each was a Tab stop (7 for kind and preset): one name
    // per group makes the group one Tab stop, the arrow keys moving the choice (the browser's own).
    document.querySelectorAll("fieldset").forEach((group, i) => {
      const name = `radio-group-${i}`;
      for (const radio of group.querySelectorAll("input[type='radio']")) if (radio.name !== name) radio.name = name;
    });
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
  document.addEventListener("click", event => {  // the saved chat opened, or none (New chat)
    const row = event.target.closest("#chat-column table[role='grid'] tbody tr");
    const newChat = event.target.closest("#chat-column .row:has(#chat-log) > .column:first-child > button");
    if (!row && !newChat) return;
    window.personaChatOpen = row ? [...row.parentElement.children].indexOf(row) : null;
    tidy();
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
  window.personaTidy = tidy;
  // What this browser stored under another key (the state folder lost, a Space restarted without
  // PERSONA_CHAT_BROWSER_KEY: webui/server_state.py) cannot be read, and gradio then shows nothing,
  // silently. A fingerprint of the key (the key itself is in the page anyway) tells: say so.
  const stores = (window.gradio_config?.components || []).filter(c => c.type === "browserstate");
  const secret = stores[0]?.props?.secret;
  if (secret) {
    let hash = 5381;
    for (const c of secret) hash = (hash * 33 + c.charCodeAt(0)) >>> 0;
    const id = hash.toString(16), seen = localStorage.getItem("persona-chat-key-id");
    const stored = stores.some(c => localStorage.getItem(c.props.storage_key));
    const banner = document.getElementById("serving-status");
    if (seen && seen !== id && stored && banner && !document.getElementById("browser-key-changed")) {
      const note = document.createElement("p");
      note.id = "browser-key-changed";
      note.setAttribute("role", "status");
      note.textContent = "⚠️ Saved chats (and a login) this browser kept from before the server restarted can no " +
        "longer be read: the server's key for them changed (on a Space, the secret PERSONA_CHAT_BROWSER_KEY keeps it).";
      banner.after(note);
    }
    localStorage.setItem("persona-chat-key-id", id);
  }
}
"""
