"""A headless Chromium driven by Selenium, for page tests; skipped where it is not installed.

Debian's ``chromium`` and ``chromium-driver`` packages (``.ci/run`` installs them when it
runs as root); Selenium is pointed at their files, so it never downloads a browser.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest

INSTALL_COMMAND = "apt-get update && apt-get install -y chromium chromium-driver"


@contextlib.contextmanager
def headless_chromium(width: int = 1600, height: int = 1500) -> Iterator[object]:
    """A Chrome WebDriver that keeps the page's console log (``driver.get_log("browser")``)."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        pytest.skip(f"no chromium / chromedriver on PATH; install them with: {INSTALL_COMMAND}")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--hide-scrollbars",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(
        service=webdriver.ChromeService(executable_path=chromedriver), options=options
    )
    try:
        yield driver
    finally:
        driver.quit()  # ends the chromedriver and browser processes this driver started
