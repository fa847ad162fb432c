"""What the browser tests share: Debian's chromium driven by Playwright (never a downloaded
browser), and the marker that skips them, saying why, where either is missing."""

import os
from pathlib import Path

import pytest

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    expect = sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
VIEWPORTS = {"desktop": {"width": 1366, "height": 900}, "phone": {"width": 390, "height": 844}}  # what users have
needs_browser = pytest.mark.skipif(
    sync_playwright is None or not CHROMIUM.exists(),
    reason="browser test needs Playwright (`pip install playwright`) and Debian's chromium (/usr/bin/chromium, "
    "`apt-get install chromium`); .ci/run installs both",
)


def screenshot_folder(tmp_path_factory, name: str) -> Path:
    """Where a browser test keeps its screenshots: $PERSONA_CHAT_SCREENSHOTS (a CI artifact), else a
    temporary folder."""
    folder = Path(os.environ.get("PERSONA_CHAT_SCREENSHOTS") or tmp_path_factory.mktemp(name))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def shout(request, text: str) -> None:
    """Print even without -s (screenshot folders and measured numbers belong in every run's output)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{text}")
