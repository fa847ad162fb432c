"""What the browser tests share: Debian's chromium driven by Playwright (never a downloaded
browser), and the marker that skips them, saying why, where either is missing."""

from pathlib import Path

import pytest

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    expect = sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
needs_browser = pytest.mark.skipif(
    sync_playwright is None or not CHROMIUM.exists(),
    reason="browser test needs Playwright (`pip install playwright`) and Debian's chromium (/usr/bin/chromium, "
    "`apt-get install chromium`); .ci/run installs both",
)
