"""A LoRA adapter trained from the Train tab in a real browser (headless Debian chromium through
Playwright), on a desktop (1366x900) and on a phone (390x844): the LoRA fields, the exact flags Show
command prints, the pre-flight line, a tiny run to its end, the finished adapter offered as the base
to continue (with its own settings), and the push panel's merged-model choice.

Screenshots go to ``$PERSONA_CHAT_SCREENSHOTS`` if set, else to a pytest temporary folder (printed).
"""

from __future__ import annotations

import json
import time

import pytest
from browser import VIEWPORTS, expect, needs_browser, screenshot_folder, shout
from served_app import serve
from test_browser_train import fill, more_settings, run_text, train_tab

from chat.adapters import ADAPTER_CONFIG, base_of, is_adapter_dir

pytestmark = needs_browser

PASSWORD = "browser-lora-password"
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve(tmp_path_factory, "browser-lora", PASSWORD)


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = screenshot_folder(tmp_path_factory, "screenshots")
    yield folder
    shout(request, f"LoRA browser screenshots: {folder}")


@pytest.fixture(params=list(VIEWPORTS))
def page(request, served, browser, shots):
    context = browser.new_context(viewport=VIEWPORTS[request.param])
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(served.url)
    expect(page.locator("#chat-input textarea")).to_be_visible()
    page.shot = lambda name: page.screenshot(path=shots / f"lora-{name}-{request.param}.png", full_page=True)
    page.size = request.param
    yield page
    context.close()


def test_a_lora_adapter_trained_from_the_train_tab(page, served):
    train_tab(page)
    fill(page, "train-password", PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")
    # full fine-tuning at first: no LoRA fields
    expect(page.locator("#train-adapter input[value=none]")).to_be_checked()
    expect(page.locator("#train-lora-r")).to_be_hidden()
    page.locator("#train-adapter").get_by_text("LoRA adapter").click()
    for elem_id in ("train-lora-r", "train-lora-alpha", "train-lora-modules"):
        expect(page.locator(f"#{elem_id}")).to_be_visible()
    fill(page, "train-lora-r", 4)
    page.locator("#train-lora-modules").get_by_text("feed-forward in").click()  # off
    page.locator("#train-lora-modules").get_by_text("feed-forward out").click()  # off
    expect(page.locator("#train-preflight")).to_contain_text("LoRA trains ")
    for elem_id, value in (("train-n-train", 32), ("train-n-val", 8), ("train-epochs", 1)):
        fill(page, elem_id, value)
    more_settings(page)
    fill(page, "train-beams", 1)
    page.locator("#train-show-command").click()
    command = page.locator("#train-command")
    for flag in ("--adapter lora", "--lora_r 4", "--lora_target_modules q_proj,k_proj,v_proj,out_proj"):
        expect(command).to_contain_text(flag)  # (one flag a line)
    page.shot("1-form")

    page.locator("#train-start").click()
    expect(page.locator("#train-action")).to_contain_text("Started run")
    run_id = served.tab.manager.status().run_id
    deadline = time.monotonic() + RUN_TIMEOUT_S
    # (the line may still show the previous size's finished run until the next redraw)
    while run_id not in (text := run_text(page)) or "finished" not in text:
        assert "failed" not in text, text
        assert time.monotonic() < deadline, f"no result in time:\n{text}"
        page.wait_for_timeout(1000)
    page.shot("2-finished")
    final = served.runs / run_id / "final"
    assert is_adapter_dir(final) and not (final / "model.safetensors").exists()
    config = json.loads((final / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert base_of(final)[0] == "tiny"

    # the finished adapter is a base to continue: trained further with its own settings
    page.locator("#train-model input").click()
    page.get_by_role("option", name=f"continue from run {run_id}").click()
    page.locator("#train-show-command").click()
    for flag in (f"{run_id}/final", "--adapter lora", "--lora_r 4"):
        expect(command).to_contain_text(flag)
    page.locator("#train-push-panel").get_by_text("Push the finished run").click()
    expect(page.locator("#train-push-merged")).to_be_visible()
    page.shot("3-continue-and-push")
