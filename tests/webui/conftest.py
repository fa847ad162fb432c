"""Fixtures of the browser tests (tests/webui/browser.py has the rest of what they share)."""

import pytest
from browser import CHROMIUM, sync_playwright


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium, launched once per test module (each test opens its own context)."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield browser
        browser.close()
