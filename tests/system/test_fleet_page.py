"""The live fleet page in headless Chromium (Debian's chromium and chromium-driver, driven
by selenium) against a live ``carpool up --page ... --traffic ...``: it draws the workers
and the live figures, and its control changes the number of workers the broker lists."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from carpool.client import Client
from tests.system.upfleet import UpFleet

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: Where to keep the page's picture as well (docs/img/fleet-page.png is made this way).
SCREENSHOT_ENV = "FLEET_PAGE_SCREENSHOT"
#: A synthetic model whose batch costs 5 ms + 1 ms a sample (a sleep: no CPU), under 80
#: requests a second: some batches hold more than one request.
FLEET_ARGS = ("--synthetic", "5", "1", "--traffic", "80")

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra")
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(
        f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
        "apt-get install chromium chromium-driver",
        allow_module_level=True,
    )


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,960",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _text(driver: Any, selector: str) -> str:
    """The text of the first element ``selector`` finds ("" for none), read in the page
    (the page redraws every second: a handle to an element would go stale)."""
    script = "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';"
    return str(driver.execute_script(script, selector))


def _number(driver: Any, element_id: str) -> float | None:
    text = _text(driver, f"#{element_id}")
    try:
        return float(text)
    except ValueError:
        return None  # "–": no figure yet


def _cards(driver: Any) -> list[str]:
    script = (
        "return [...document.querySelectorAll('.worker[data-registered=\"true\"]')]"
        ".map(e => e.dataset.worker);"
    )
    return sorted(str(name) for name in driver.execute_script(script))


def test_the_page_draws_the_fleet_and_its_control_changes_the_workers(
    tmp_path: Path, browser: Any
) -> None:
    fleet = UpFleet(tmp_path, "--workers", "2", *FLEET_ARGS, "--page", "127.0.0.1:0")
    try:
        url, token = fleet.page_url()
        with Client(fleet.frontend) as client:
            fleet.until_workers(client, ["worker-0", "worker-1"])
            browser.get(f"{url}#token={token}")
            assert "#token" not in browser.current_url  # taken out of the address bar
            fleet.until("two worker cards", lambda: _cards(browser) == ["worker-0", "worker-1"])
            fleet.until("a QPS above 0", lambda: (_number(browser, "qps") or 0) > 0)
            fleet.until("a p95", lambda: _number(browser, "p95") is not None)
            fleet.until("a mean batch size", lambda: _number(browser, "mean-batch") is not None)
            assert _text(browser, "#histogram .bar")
            card = _text(browser, '[data-worker="worker-0"]')
            assert "ρ" in card
            assert "(synthetic)" in card
            assert _number(browser, "live-workers") == 2

            browser.find_element("id", "workers-plus").click()
            browser.find_element("id", "workers-apply").click()
            fleet.until(
                "the page's request taken",
                lambda: "asked for 3 workers" in _text(browser, "#control-message"),
            )
            fleet.until_workers(client, ["worker-0", "worker-1", "worker-2"])
            three = ["worker-0", "worker-1", "worker-2"]
            fleet.until("carpool status --json lists 3", lambda: fleet.status_workers() == three)
            fleet.until("three worker cards", lambda: len(_cards(browser)) == 3)
            fleet.until(
                "the third worker busy",
                lambda: "ρ 0.00" not in _text(browser, '[data-worker="worker-2"]'),
            )
            browser.save_screenshot(str(tmp_path / "fleet-page.png"))
            if os.environ.get(SCREENSHOT_ENV):
                shutil.copyfile(tmp_path / "fleet-page.png", os.environ[SCREENSHOT_ENV])

            browser.find_element("id", "workers-minus").click()
            browser.find_element("id", "workers-minus").click()
            browser.find_element("id", "workers-apply").click()
            fleet.until_workers(client, ["worker-0"])
            fleet.until(
                "carpool status --json lists 1", lambda: fleet.status_workers() == ["worker-0"]
            )
            fleet.until("one worker card", lambda: _cards(browser) == ["worker-0"])
    finally:
        code = fleet.stop()
    assert code == 0, fleet.output()
    assert fleet.left == []
    assert "page: workers set to 3" in fleet.output()
