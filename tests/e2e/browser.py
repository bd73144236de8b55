"""Headless Chromium for the dashboard tests: Debian's `chromium` package (on a
Mac, the Chromium app), driven by Playwright (whose own browser download is not used)."""

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Error, Page, sync_playwright

# Where `brew install --cask chromium` puts it (not on PATH).
MAC_CHROMIUM = "/Applications/Chromium.app/Contents/MacOS/Chromium"


def chromium_path() -> str:
    """The system Chromium; the tests skip without it, except in CI, where it must be."""
    path = shutil.which("chromium")
    if path is None and sys.platform == "darwin" and os.path.exists(MAC_CHROMIUM):
        path = MAC_CHROMIUM
    if path is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail("chromium is missing: .ci/run installs Debian's chromium package")
        install = (
            "brew install --cask chromium"
            if sys.platform == "darwin"
            else "apt-get install chromium"
        )
        pytest.skip(f"the browser tests need Chromium: {install}")
    return path


@contextmanager
def headless_chromium() -> Iterator[Browser]:
    executable = chromium_path()
    with sync_playwright() as playwright:
        # CI runs as root, where Chromium's sandbox cannot start.
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


class PageErrors:
    """Every console error and uncaught exception of a page, as text."""

    def __init__(self, page: Page) -> None:
        self.seen: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", self._page_error)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.seen.append(f"console error: {message.text} ({message.location.get('url')})")

    def _page_error(self, error: Error) -> None:
        self.seen.append(f"page error: {error.message}")
