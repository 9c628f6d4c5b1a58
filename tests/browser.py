"""A headless Chromium for the page tests: Debian's chromium with its own chromedriver, driven by Selenium (no
browser download, no network). `browser()` is None, with the reason, where either is missing."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
# the flags a closed network needs: without the background-networking ones Chromium keeps trying hosts it cannot reach
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=760,1500")


def missing() -> str | None:
    """Why there is no browser to test with, or None."""
    try:
        import selenium

        del selenium
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    if not any(shutil.which(c) for c in CHROMIUM):
        return "no chromium on PATH (Debian: apt install chromium chromium-driver)"
    if not shutil.which("chromedriver"):
        return "no chromedriver on PATH (Debian: apt install chromium-driver)"
    return None


@contextmanager
def chromium():
    """A Selenium driver of headless Chromium with a fresh profile, the console log kept."""
    from selenium import webdriver

    binary = next(shutil.which(c) for c in CHROMIUM if shutil.which(c))
    with tempfile.TemporaryDirectory() as profile:
        opts = webdriver.ChromeOptions()
        opts.binary_location = binary
        for flag in (*FLAGS, f"--user-data-dir={profile}"):
            opts.add_argument(flag)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
        os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not look for a driver online
        driver = webdriver.Chrome(options=opts, service=service)
        try:
            driver.set_script_timeout(30)
            yield driver
        finally:
            driver.quit()


def errors(driver) -> list[str]:
    """The console's errors since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


if __name__ == "__main__":  # `python tests/browser.py`: one line, where the browser tests will be skipped, saying why
    why = missing()
    if why:
        print(f"note: the pages' browser tests are skipped: {why}")
