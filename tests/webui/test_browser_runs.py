"""The runs view in a real browser (headless Debian chromium through Playwright), desktop (1366x900)
and phone (390x844): three runs trained on the demo model by the real CLI (one continued from
another, one stopped early) plus a corrupt and a foreign folder, found with their lineage and
states; two overlaid with the settings that differ; one served in the chat; one deleted.

One served app and one runs folder for the module; each viewport has its own page and login,
and deletes a different folder (the desktop the stopped run, the phone the foreign folder).
"""

from __future__ import annotations

import time

import pytest
from browser import VIEWPORTS, expect, needs_browser, screenshot_folder, shout
from run_folders import CORRUPT, FIRST, FOREIGN, SECOND, STOPPED, make_runs
from served_app import App

from webui import auth

pytestmark = needs_browser

PASSWORD = "browser-runs-password"
DELETED: set[str] = set()
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def served(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("browser-runs")
    started = time.perf_counter()
    make_runs(folder / "runs")  # the folder App serves as its runs root
    TIMINGS["three CLI runs"] = time.perf_counter() - started
    app = App(folder, auth.AuthConfig(password=PASSWORD))
    yield app
    app.close()
    shout(request, "runs browser timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in TIMINGS.items()))


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = screenshot_folder(tmp_path_factory, "screenshots")
    yield folder
    shout(request, f"runs browser screenshots: {folder}")


@pytest.fixture(scope="module", params=list(VIEWPORTS))
def page(request, served, browser, shots):
    context = browser.new_context(viewport=VIEWPORTS[request.param])
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(served.url)
    expect(page.locator("#chat-input textarea")).to_be_visible()
    page.size = request.param
    page.shot = lambda name: page.screenshot(path=shots / f"runs-{name}-{request.param}.png", full_page=True)
    yield page
    context.close()


@pytest.fixture(autouse=True)
def _timed(request):
    started = time.perf_counter()
    yield
    TIMINGS[request.node.name.removeprefix("test_")] = time.perf_counter() - started


def pick(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option).first.click()


def row(page, run_id: str):
    # gradio 6 draws its rows as divs; a run's id is in its first cell (others name it as a parent)
    first_cell = page.locator(".first-column", has_text=run_id)
    return page.locator("#runs-table .virtual-row").filter(has=first_cell)


def open_runs(page) -> None:
    page.get_by_role("tab", name="Train").click()
    if not page.locator("#runs-table").is_visible():
        page.locator("#runs-panel").get_by_text("Runs: history").click()
    expect(row(page, FIRST)).to_be_visible()


def test_every_run_is_listed_with_its_state_and_lineage(page):
    open_runs(page)
    expect(row(page, SECOND)).to_contain_text("finished")
    expect(row(page, SECOND)).to_contain_text(f"run {FIRST}")  # its base: the first run's model, no path
    expect(row(page, FIRST)).to_contain_text("finished")
    if STOPPED not in DELETED:
        expect(row(page, STOPPED)).to_contain_text("stopped")
    expect(row(page, CORRUPT)).to_contain_text("corrupt")
    if FOREIGN not in DELETED:
        expect(row(page, FOREIGN)).to_contain_text("foreign")
    expect(page.locator("#runs-summary")).to_contain_text("not readable runs")
    # The demo model's context score beside its BLEU (a number, for both finished runs).
    for run_id in (FIRST, SECOND):
        assert "0." in row(page, run_id).inner_text()
    page.shot("1-listed")


def test_two_runs_overlay_their_curves_and_show_the_settings_that_differ(page):
    pick(page, "runs-select", f"{FIRST} (finished)")
    pick(page, "runs-select", f"{SECOND} (finished)")
    page.keyboard.press("Escape")
    expect(page.locator("#runs-compare-note")).to_contain_text("2 runs overlaid")
    diff = page.locator("#runs-diff")
    expect(diff).to_contain_text("learning_rate")
    expect(diff).to_contain_text("model_name_or_path")
    expect(diff).to_contain_text(f"run {FIRST}")
    assert "dataset_name" not in diff.inner_text()  # the same in both: not shown
    for plot in ("loss", "bleu", "context-hits"):
        expect(page.locator(f"#runs-plot-{plot} [aria-label^='step: ']").first).to_be_attached()
    page.shot("2-overlaid")


def test_serve_a_run_in_the_chat_after_logging_in(page):
    target = SECOND if page.size == "desktop" else FIRST
    page.locator("#runs-serve").click()
    expect(page.locator("#runs-action")).to_contain_text("log in")  # watching is open, acting is not
    page.locator("#train-password input").fill(PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")
    pick(page, "runs-target", f"{target} (finished)")
    page.locator("#runs-serve").click()
    expect(page.locator("#runs-action")).to_contain_text("Now serving", timeout=60_000)
    expect(page.locator("#serving-status")).to_contain_text(f"{target}/final")
    page.shot("3-served")


def test_the_serving_run_is_kept_and_another_is_deleted_after_a_confirmation(page):
    serving = SECOND if page.size == "desktop" else FIRST
    pick(page, "runs-target", f"{serving} (finished)")
    page.locator("#runs-delete").click()
    expect(page.locator("#runs-action")).to_contain_text("serving in the chat")
    expect(page.locator("#runs-confirm")).to_be_hidden()
    doomed, state = (STOPPED, "stopped") if page.size == "desktop" else (FOREIGN, "foreign")
    pick(page, "runs-target", f"{doomed} ({state})")
    page.locator("#runs-delete").click()
    expect(page.locator("#runs-action")).to_contain_text("cannot be undone")
    page.shot("4-confirm")
    page.locator("#runs-confirm").click()
    expect(page.locator("#runs-action")).to_contain_text("Deleted")
    DELETED.add(doomed)
    expect(row(page, doomed)).to_have_count(0)
    expect(row(page, FIRST)).to_be_visible()
    page.shot("4-deleted")
