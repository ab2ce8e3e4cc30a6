"""Headless Chromium driven through chromedriver (Selenium), for tests of what a user looks at.

``open_browser`` fails the test, saying what to install, when Debian's ``chromium`` or
``chromium-driver`` or the ``selenium`` package is missing. ``Page.errors`` are the browser's own
reports of script trouble since the page was opened: console errors and uncaught exceptions
(chromedriver's ``browser`` log at level SEVERE from the page's scripts). Failed requests are
kept apart (``Page.failed_requests``): offline, a card's Google Fonts stylesheet fails to load,
and MLflow 3.17's UI asks every server for ``/ajax-api/2.0/mlflow/users/current``, which a
server without the auth plugin answers 404.
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Callable

import pytest

INSTALL = ("apt-get install -y chromium chromium-driver (Debian's packages; .ci/run installs them) "
           "and pip install -r requirements-dev.txt (selenium)")
PAGE_TIMEOUT_S = 60  # a React page on a busy 2-core CI machine
# Chromium's report that a ResizeObserver callback resized what it observes (MLflow's chart grid
# does): the spec's loop guard, which delivers the rest in the next frame; nothing is lost.
BENIGN = ("ResizeObserver loop completed with undelivered notifications",)
SCROLL_STEP_JS = """
for (const e of [document.scrollingElement, ...document.querySelectorAll('*')]) {
  if (e && e.scrollHeight > e.clientHeight + 10 &&
      (e === document.scrollingElement || /auto|scroll/.test(getComputedStyle(e).overflowY))) {
    e.scrollTop = e.scrollTop + e.clientHeight / 2 >= e.scrollHeight - e.clientHeight ? 0
                : e.scrollTop + e.clientHeight / 2;
  }
}"""


def open_browser():
    """A headless Chromium session; the caller quits it."""
    missing = [b for b in ("chromium", "chromedriver") if shutil.which(b) is None]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (Python)")
    if missing:
        pytest.fail(f"the browser tests need {', '.join(missing)}: {INSTALL}", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1600,1200", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


class Page:
    """A page opened in ``driver``: its rendered text, elements and script errors."""

    def __init__(self, driver, url: str):
        self.driver, self.url = driver, url
        driver.get_log("browser")  # drop what earlier pages reported
        driver.get(url)
        self._log: list[dict] = []

    def wait_for(self, condition: Callable[[], object], what: str, timeout: float = PAGE_TIMEOUT_S):
        """Poll ``condition`` until it returns something truthy; fail naming ``what`` and the page's text."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got = condition()
            except Exception:  # the DOM is still being built: elements come and go
                got = None
            if got:
                return got
            time.sleep(0.25)
        pytest.fail(f"{self.url}: {what} not rendered within {timeout:.0f} s; the page shows:\n"
                    f"{self.text()[:3000]}\nscript errors: {self.errors()}", pytrace=False)

    def wait_for_text(self, *needles: str, timeout: float = PAGE_TIMEOUT_S) -> str:
        """The page's visible text, once it holds every one of ``needles``."""
        def holds_them():
            text = self.text()
            return text if all(n in text for n in needles) else None

        return self.wait_for(holds_them, f"the text {needles!r}", timeout)

    def wait_for_text_while_scrolling(self, *needles: str, timeout: float = PAGE_TIMEOUT_S) -> None:
        """Wait until every one of ``needles`` has been shown, scrolling down a step at a time (pages
        such as MLflow's metric charts render only what is in view)."""
        seen: set[str] = set()

        def all_seen():
            text = self.text()
            seen.update(n for n in needles if n in text)
            self.js(SCROLL_STEP_JS)
            return seen == set(needles)

        self.wait_for(all_seen, f"the text {sorted(set(needles) - seen)!r}", timeout)

    def text(self) -> str:
        return self.driver.find_element("tag name", "body").text

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def tables(self) -> list[dict]:
        """Every rendered <table>: its header cells and its body rows' cells, as the user reads them."""
        return self.js("""
            return [...document.querySelectorAll('table')].map(t => ({
              headers: [...t.querySelectorAll('thead th')].map(c => c.innerText.trim()),
              rows: [...t.querySelectorAll('tbody tr')].map(r => [...r.querySelectorAll('td')]
                                                       .map(c => c.innerText.trim()))}));""")

    def _severe(self) -> list[dict]:
        self._log += self.driver.get_log("browser")
        return [e for e in self._log if e["level"] == "SEVERE"]

    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions reported since the page was opened."""
        return [e["message"] for e in self._severe()
                if e.get("source") != "network" and not any(b in e["message"] for b in BENIGN)]

    def failed_requests(self) -> list[str]:
        """Requests the browser reported failed (HTTP errors, refused connections)."""
        return [e["message"] for e in self._severe() if e.get("source") == "network"]
