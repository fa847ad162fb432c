"""The Train tab in a real browser (headless Debian chromium through Playwright), on a desktop
(1366x900) and on a phone (390x844).

One served app for the module; the tests of one viewport share one page (pytest runs every test
of the desktop page, then every test of the phone page) and one tiny run: started in
``test_a_tiny_run_shows_its_start_its_loss_curve_and_its_log``, stopped and resumed in
``test_stop_then_resume_then_the_first_bleu_and_every_step``, so they run in this file's order
(each viewport starts its own run).

Every test keeps screenshots: in ``$PERSONA_CHAT_SCREENSHOTS`` if set, else in a pytest temporary
folder; the folder, the phone's page height and the module's timings are printed at the end.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from browser import VIEWPORTS, expect, needs_browser, screenshot_folder, shout
from served_app import serve

from chat.engine import DEFAULT_MODEL
from finetune.jobs.status import read_events
from webui import train_handlers, train_view

pytestmark = needs_browser

PASSWORD = "browser-train-password"
POINT = "[aria-label^='step: ']"  # vega draws one labelled mark per data point
NUMBER = re.compile(r"-?[\d,]+(\.\d{1,2})?")  # an axis tick: a number with at most 2 decimals
# The run: 1408 of the sample's 1423 rows, batch 'auto' (8 on the CPU) on 2 processes = 88 steps an epoch,
# 3 epochs, a loss point per step: Stop comes a few seconds into it (after the curve's first points), long
# before its end however fast the machine; the first BLEU point comes after the resume.
ROWS, EPOCHS = 1408, 3
STEPS = ROWS // 16 * EPOCHS
RUN_TIMEOUT_S = 240
# A status tracker over a component (gradio's progress or "Error" badge) or an error toast.
BADGES = ".wrap.full:not(.hide), .wrap.minimal:not(.hide), .wrap.error, .toast-body.error"
TIMINGS: dict[str, float] = {}
NOTES: list[str] = []  # what the run showed, printed at the end


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve(tmp_path_factory, "browser-train", PASSWORD)


@pytest.fixture(scope="module")
def shots(tmp_path_factory, request):
    folder = screenshot_folder(tmp_path_factory, "screenshots")
    started = time.perf_counter()
    yield folder
    timings = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in TIMINGS.items())
    total = time.perf_counter() - started
    notes = "".join(f"\n{note}" for note in NOTES)
    shout(
        request, f"train browser screenshots: {folder}\ntrain browser timings: {timings}; module {total:.0f} s{notes}"
    )


@pytest.fixture(scope="module", params=list(VIEWPORTS))
def page(request, served, browser, shots):
    """One page per viewport, shared by the module's tests in order (login, then the run)."""
    context = browser.new_context(viewport=VIEWPORTS[request.param])
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.requests = []  # (fn_index, time) of every event request the page sends
    # (Playwright delivers the events while the test waits through it: page.wait_for_timeout, not time.sleep.)
    page.on("request", lambda r: page.requests.append((_fn_index(r), time.monotonic())))
    page.goto(served.url)
    expect(page.locator("#chat-input textarea")).to_be_visible()
    page.size = request.param
    page.shot = lambda name: page.screenshot(path=shots / f"train-{name}-{request.param}.png", full_page=True)
    yield page
    context.close()


@pytest.fixture(autouse=True)
def _timed(request):
    started = time.perf_counter()
    yield
    name = request.node.name.removeprefix("test_")
    TIMINGS[name] = time.perf_counter() - started


def _fn_index(request) -> int | None:
    """The event a request to gradio's API runs (queued or not), None for anything else."""
    if "/gradio_api/" not in request.url or request.method != "POST":
        return None
    try:
        return json.loads(request.post_data or "{}").get("fn_index")
    except ValueError:
        return None


def train_tab(page):
    page.get_by_role("tab", name="Train").click()
    expect(page.locator("#train-run")).to_be_visible()


def more_settings(page):
    """Open the collapsed "More settings" (batches, strategy, logging) once."""
    if not page.locator("#train-batch").is_visible():
        page.locator("#train-more").get_by_text("More settings").click()
    expect(page.locator("#train-batch")).to_be_visible()


def fill(page, elem_id: str, value) -> None:
    page.locator(f"#{elem_id} input, #{elem_id} textarea").first.fill(str(value))


def pick(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option).click()


def badges(page, *selectors: str) -> list[str]:
    """Visible progress / error badges over the components ``selectors`` (and error toasts)."""
    found = []
    for selector in selectors:
        for badge in page.locator(selector).locator(BADGES).all():
            if badge.is_visible():
                found.append(f"{selector}: {badge.inner_text()!r}")
    return found + [f"toast: {t.inner_text()!r}" for t in page.locator(".toast-body.error").all() if t.is_visible()]


def marks(page, elem_id: str, y: str) -> list[dict]:
    """The points a plot draws: step, value and the centre of each mark on the screen (one per step)."""
    rows = page.locator(f"#{elem_id} .mark-symbol > {POINT}").evaluate_all(  # not the line, labelled as its 1st point
        """marks => marks.map(m => {
            const box = m.getBoundingClientRect();
            return {label: m.getAttribute('aria-label'), x: box.x + box.width / 2, y: box.y + box.height / 2,
                    left: box.left, right: box.right, top: box.top, bottom: box.bottom};
        })"""
    )
    points = {}
    for row in rows:
        found = re.match(rf"step: (\d+); {y}: ([-\d.e]+)", row["label"])
        points.setdefault(int(found.group(1)), {**row, "step": int(found.group(1)), y: float(found.group(2))})
    return [points[step] for step in sorted(points)]


def tick_labels(page, elem_id: str) -> list[str]:
    return page.locator(f"#{elem_id} .role-axis-label text").evaluate_all("texts => texts.map(t => t.textContent)")


def newest_line_in_view(page) -> None:
    """The log box is scrolled to its end (its lines wrap, a phone's many times)."""
    page.locator("#train-log").scroll_into_view_if_needed()
    page.wait_for_function(
        "() => { const t = document.querySelector('#train-log textarea');"
        " return t.value && t.scrollHeight > 0 && t.scrollTop + t.clientHeight >= t.scrollHeight - 2; }",
        timeout=5000,
    )


def run_text(page) -> str:
    return page.locator("#train-run").inner_text()


def wait_run(page, pattern: str, timeout_s: float = RUN_TIMEOUT_S, seen: list | None = None) -> str:
    """Poll the run text until it matches ``pattern``, recording every text shown on the way."""
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, text := run_text(page)):
        assert "failed" not in text, text
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {pattern!r}; the run shows:\n{text}"
        if seen is not None and (not seen or seen[-1] != text):
            seen.append(text)
        page.wait_for_timeout(250)
    if seen is not None:
        seen.append(text)
    return text


# --------------------------------------------------------------------------- before a login


def test_the_timer_polls_only_while_the_train_tab_is_shown(page, request):
    config = page.evaluate("() => window.gradio_config")
    timers = {c["id"] for c in config["components"] if c.get("type") == "timer"}
    ticks = {d["id"] for d in config["dependencies"] if any(t[0] in timers and t[1] == "tick" for t in d["targets"])}
    assert len(ticks) == 1, config["dependencies"]  # the live view's redraw (the preference plot too)

    def count(seconds: float) -> int:
        since = time.monotonic()
        page.wait_for_timeout(seconds * 1000)
        return sum(1 for fn, at in page.requests if fn in ticks and at >= since)

    train_tab(page)
    page.wait_for_timeout(1000)  # the tab's select event turns the timer on
    on_train = count(5)
    page.get_by_role("tab", name="Chat").click()
    page.wait_for_timeout(1000)  # the select event turns it off; a tick already sent may still arrive
    on_chat = count(5)
    shout(request, f"[{page.size}] the timer's requests in 5 s: {on_train} on the Train tab, {on_chat} on the Chat tab")
    assert on_train >= 2 and on_chat == 0, (on_train, on_chat)


def test_a_refused_load_says_why_and_leaves_no_badge(page):
    page.get_by_role("tab", name="Chat").click()
    page.get_by_role("button", name="Model").first.click()  # the accordion
    page.locator("#model-load").click()
    note = page.locator("#model-load-note")
    expect(note).to_contain_text("log in")
    page.shot("2-load-refused")
    page.wait_for_timeout(3000)
    assert not badges(page, "#model-picker", "#serving-status", "#model-load-note"), badges(page, "#model-picker")
    expect(note).to_contain_text("log in")  # still there, where the user looks


def test_the_controls_are_locked_until_a_login(page):
    train_tab(page)
    page.locator("#train-push-panel").get_by_text("Push the finished run").click()  # collapsed at first
    controls = ["#train-start", "#train-stop", "#train-resume", "#train-push"]
    fields = ["#train-model input", "#train-n-train input", "#train-epochs input", "#train-data input"]
    for selector in controls + fields:
        expect(page.locator(selector).first).to_be_disabled()
    note = page.locator("#train-lock-note")
    expect(note).to_be_visible()
    expect(note).to_contain_text("unlock when you log in")
    assert "\n" not in note.inner_text().strip()  # one line, one reason
    assert page.get_by_text("unlock when you log in").count() == 1
    page.shot("1-locked")
    fill(page, "train-password", PASSWORD)
    page.locator("#train-login").click()
    expect(page.locator("#train-auth")).to_contain_text("Logged in")
    for selector in controls + fields:
        expect(page.locator(selector).first).to_be_enabled()
    expect(note).not_to_contain_text("unlock")
    page.shot("1-unlocked")


def test_show_command_refusals_say_why_in_the_command_box(page):
    command = page.locator("#train-command")
    pick(page, "train-model", f"{DEFAULT_MODEL} (400M)")
    page.locator("#train-show-command").click()
    expect(command).to_contain_text("# no command:")
    expect(command).to_contain_text("needs a GPU")
    page.shot("2-command-400m-on-cpu")
    pick(page, "train-model", "tiny (a small BlenderBot")
    more_settings(page)
    page.get_by_role("radio", name="DDP").check()
    page.locator("#train-show-command").click()
    expect(command).to_contain_text("'ddp' needs GPUs")
    page.shot("2-command-ddp-on-cpu")
    page.wait_for_timeout(2000)
    assert not badges(page, "#train-command", "#train-show-command"), badges(page, "#train-command")
    page.get_by_role("radio", name="DeepSpeed ZeRO-2").check()
    page.locator("#train-show-command").click()
    expect(command).to_contain_text("-m finetune \\ --model_name_or_path tiny \\")  # one flag a line
    expect(command).to_contain_text("--per_device_train_batch_size auto")  # the box's default, to the CLI


def test_the_preflight_line_follows_the_batch(page):
    line = page.locator("#train-preflight")
    more_settings(page)
    expect(page.locator("#train-batch textarea, #train-batch input").first).to_have_value("auto")
    expect(line).to_contain_text("CPU run")
    expect(line).to_contain_text("auto means the CPU default, 8 rows per process")
    expect(line).to_contain_text("no GPU memory estimate")
    page.shot("6-preflight-auto")
    fill(page, "train-batch", "16")
    expect(line).to_contain_text("this run: 16 rows per process")
    fill(page, "train-batch", "lots")
    expect(line).to_contain_text("must be a positive whole number or 'auto', got 'lots'")
    page.shot("6-preflight-refused")
    page.locator("#train-show-command").click()
    expect(page.locator("#train-command")).to_contain_text("Train batch (per device) must be a positive whole number")
    fill(page, "train-batch", "auto")
    expect(line).not_to_contain_text("this run")
    expect(line).to_contain_text("auto means the CPU default")
    page.locator("#train-show-command").click()
    expect(page.locator("#train-command")).to_contain_text("--per_device_train_batch_size auto")


def test_a_refused_upload_is_cleared_and_named(page, tmp_path):
    bad = tmp_path / "my chats.jsonl"
    good_row = json.dumps({"texts": "context: happy  <s> hello", "labels": "hi!"})
    bad.write_text(good_row + "\n" + json.dumps({"texts": "context: happy  <s> hi", "labels": " "}) + "\n")
    page.get_by_role("radio", name="Uploaded file").check()
    page.locator("#train-file input[type=file]").set_input_files(str(bad))
    preview = page.locator("#train-preview")
    expect(preview).to_contain_text("Cannot upload data")
    text = preview.inner_text()
    assert "my chats.jsonl" in text and "row 2" in text, text
    assert "/tmp" not in text and "gradio" not in text, text  # no server path
    page.wait_for_timeout(1000)  # the box's own events have run
    expect(page.locator("#train-file")).not_to_contain_text("my chats.jsonl")  # nothing looks attached
    expect(preview).to_contain_text("row 2")  # and the reason stays
    page.shot("3-upload-refused")
    page.get_by_role("radio", name="Shipped sample (offline)").check()


# --------------------------------------------------------------------------- one tiny run per viewport


def test_a_tiny_run_shows_its_start_its_loss_curve_and_its_log(page, served):
    more_settings(page)
    for elem_id, value in (
        ("train-n-train", ROWS),
        ("train-n-val", 8),
        ("train-epochs", EPOCHS),
        ("train-logging", 1),
        ("train-beams", 1),
    ):
        fill(page, elem_id, value)
    page.locator("#train-start").click()
    expect(page.locator("#train-action")).to_contain_text("Started run")
    run = page.locator("#train-run")
    assert run.get_attribute("aria-live") == "polite" and run.get_attribute("role") == "status"

    # ---- the start: elapsed time, and what the CLI is doing, until the first step
    # (this run's own: on the second page size the text shows the last size's finished run until a redraw)
    run_id = served.tab.manager.runs()[0]
    seen: list[str] = []
    wait_run(page, rf"Run {run_id}\b[\s\S]*step \d+ / \d+", seen=seen)
    starting = [m for m in (re.search(r"starting \((\d+) s\): (.+?)…", t) for t in seen) if m]
    assert len({m.group(1) for m in starting}) >= 2, seen  # the elapsed time counts
    phases = {m.group(2) for m in starting}
    # The CLI's phases (its "phase" events) as the tab shows them; the app's own "launching the processes"
    # comes before the first. One lasting two redraws is always shown (a warm start can pass them all
    # between two redraws).
    events = [e for _, e in read_events(served.tab.manager.root / served.tab.manager.status().run_id)]
    steps = [e for e in events if e.get("event") in ("phase", "start")]
    spans = {e["phase"]: after["time"] - e["time"] for e, after in zip(steps, steps[1:]) if e["event"] == "phase"}
    assert phases <= {*spans, "launching the processes"}, (phases, spans)
    long = {phase for phase, span in spans.items() if span >= 2 * train_handlers.TICK_SECONDS}
    assert not long or phases & long, (phases, spans)
    lasted = ", ".join(f"{phase} {span:.1f} s" for phase, span in spans.items())
    NOTES.append(f"[{page.size}] CLI phases shown: {sorted(phases & set(spans))}; they lasted: {lasted}")
    page.shot("4-training")

    # ---- the loss plot, once it has a few points: numeric axes, a falling loss drawn falling
    page.wait_for_function(
        f"() => document.querySelectorAll({json.dumps(f'#train-loss .mark-symbol > {POINT}')}).length >= 8",
        timeout=RUN_TIMEOUT_S * 1000,
    )
    axes = page.locator("#train-loss [aria-label*='-axis titled']").evaluate_all(
        "axes => axes.map(a => a.getAttribute('aria-label'))"
    )
    assert len(axes) == 2 and all("linear scale" in a for a in axes), axes
    ticks = tick_labels(page, "train-loss")
    assert ticks and all(NUMBER.fullmatch(t) for t in ticks), ticks
    points = marks(page, "train-loss", "loss")
    assert len(points) >= 5, points
    low, high = min(p["loss"] for p in points), max(p["loss"] for p in points)
    assert points[-1]["loss"] < points[0]["loss"] and points[-1]["y"] > points[0]["y"]  # falling, drawn falling
    y_axis = next(a for a in axes if a.startswith("Y-axis"))
    lowest = float(re.search(r"values from (-?[\d.]+)", y_axis).group(1))  # its lowest tick
    assert 0 < lowest < high, y_axis  # fitted to the curve (the tiny model's loss stays above 3), not from 0
    margin = 0.05 * (high - low)
    for a in points:  # every clearly higher loss is drawn higher on the screen (smaller y)
        assert all(a["y"] < b["y"] for b in points if a["loss"] > b["loss"] + margin), a

    # ---- the log box: its newest line in view
    newest_line_in_view(page)
    page.shot("4-log")


def test_stop_then_resume_then_the_first_bleu_and_every_step(page, served):
    action = page.locator("#train-action")
    page.locator("#train-stop").click()
    expect(action).to_contain_text("Stopping run")
    seen: list[str] = []
    wait_run(page, r": stopped", timeout_s=90, seen=seen)
    stopping = [t for t in seen if ": stopping" in t]
    assert stopping, seen
    assert not [t for t in stopping if "ETA" in t], stopping  # no countdown while it stops
    expect(action).not_to_contain_text("Stopping")  # the action line no longer says it is stopping
    page.shot("5-stopped")
    stopped = served.tab.manager.status()
    assert stopped.state == "stopped" and 0 < stopped.step < STEPS, stopped

    page.locator("#train-resume").click()
    expect(action).to_contain_text("Resumed run")
    seen = []
    wait_run(page, r"(?s): running(?!.*starting \().*samples/s", seen=seen)  # the resumed attempt trains
    restarting = [t for t in seen if ": running" in t and "starting (" in t]
    assert restarting, seen
    # no speed or ETA while it restarts: this attempt's, once it has logged a step, not the stopped one's
    assert not [t for t in restarting if "samples/s" in t or "ETA" in t], restarting

    # ---- the first evaluation: a BLEU point, drawn whole inside the plot, on an axis of round numbers
    expect(page.locator(f"#train-bleu {POINT}").first).to_be_attached(timeout=RUN_TIMEOUT_S * 1000)
    (first, *_) = marks(page, "train-bleu", "bleu")
    area = page.locator("#train-bleu g.role-frame.root > g > path.background").first.bounding_box()  # the plot area
    inside = area["x"] - 0.5 <= first["left"] and first["right"] <= area["x"] + area["width"] + 0.5
    inside &= area["y"] - 0.5 <= first["top"] and first["bottom"] <= area["y"] + area["height"] + 0.5
    assert inside, (first, area)  # not cut by the plot's edge
    ticks = tick_labels(page, "train-bleu")  # one point: not an axis of that one value with all its digits
    assert ticks and all(NUMBER.fullmatch(t) for t in ticks), ticks
    page.locator("#train-bleu").scroll_into_view_if_needed()
    page.shot("5-first-bleu")
    wait_run(page, r": finished")
    page.shot("5-finished")

    # every logged step once, as the status layer reports them (finetune's resume makes the values match
    # an uninterrupted run's; here: no step repeated or missing in what the tab draws)
    status = served.tab.manager.status()
    reported = [p["step"] for p in status.loss_points]
    assert reported == list(range(1, STEPS + 1)), reported
    page.wait_for_timeout(2500)  # the last redraw
    assert [p["step"] for p in marks(page, "train-loss", "loss")] == reported
    assert [p["step"] for p in marks(page, "train-bleu", "bleu")] == [STEPS // EPOCHS * e for e in range(1, EPOCHS + 1)]
    # the log box ends with the run's last log line (the view's, with its folders shortened)
    newest = train_view.live_view(served.tab, None, visitor=False)[6].splitlines()[-1]
    value = page.locator("#train-log textarea").input_value()
    assert value.splitlines()[-1] == newest
    newest_line_in_view(page)


# --------------------------------------------------------------------------- the layout


def test_the_page_is_short_and_buttons_keep_their_words(page, request):
    fresh = page.context.new_page()  # the tab as it opens (logged in: the same browser storage)
    fresh.goto(page.url)
    train_tab(fresh)
    fresh.wait_for_timeout(1500)  # the page-load events have drawn the run and the form
    height = fresh.evaluate("document.documentElement.scrollHeight")
    fresh.screenshot(path=str(request.getfixturevalue("shots") / f"train-7-page-{page.size}.png"), full_page=True)
    fresh.close()
    shout(request, f"[{page.size}] Train tab page height: {height} px")

    train_tab(page)
    panel = page.locator("#train-push-panel")
    if not page.locator("#train-push").is_visible():
        panel.get_by_text("Push the finished run").click()
    buttons = ["#train-start", "#train-stop", "#train-resume", "#train-show-command", "#train-push", "#train-login"]
    buttons.append("#train-push-private label")  # the push row's checkbox
    lines = {}
    for selector in buttons:
        element = page.locator(selector)
        element.scroll_into_view_if_needed()
        lines[selector] = element.evaluate(
            """b => { const tops = new Set(), walk = document.createTreeWalker(b, NodeFilter.SHOW_TEXT);
                      let clipped = false;
                      while (walk.nextNode()) {  // the lines of its words (not an icon or a checkbox's box)
                        if (!walk.currentNode.textContent.trim()) continue;
                        const r = document.createRange(); r.selectNodeContents(walk.currentNode);
                        for (const x of r.getClientRects()) {
                          if (!x.width) continue;
                          tops.add(Math.round(x.top));
                          for (let up = b; up; up = up.parentElement) {  // inside every box that clips it
                            if (getComputedStyle(up).overflowX === "visible") continue;
                            const box = up.getBoundingClientRect();
                            clipped ||= x.left < box.left - 1 || x.right > box.right + 1;
                          }
                        }
                      }
                      return clipped ? "clipped" : tops.size; }"""
        )
    page.locator("#train-push-row").scroll_into_view_if_needed()
    page.screenshot(path=str(request.getfixturevalue("shots") / f"train-7-push-row-{page.size}.png"))
    assert all(n == 1 for n in lines.values()), lines  # each button's words on one line, none cut off
    if page.size == "phone":
        # 3,410 px before this module's fixes; the Objective row and the runs view's accordion add ~130:
        # 3,538 px measured here and 3,690 px on CI's bare machine (other fonts); a new section would add 300+
        assert height <= 3800, height
