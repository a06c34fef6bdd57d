"""End to end in a real headless browser: `streamlit run app.py` on a sample capture, every page
loads without an exception; the Overview's screenshot goes to docs/screenshot.png (the README's).

Needs Debian's `chromium` (/usr/bin/chromium) and the Python `playwright` package (never
`playwright install`: no browser download). Without them the test skips and says which is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dashboard.conftest import ROOT

CHROMIUM = Path(os.environ.get("KVSCOPE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = {"": "Overview", "memory": "Memory", "tree": "Radix tree", "evictions": "Evictions", "leaks": "Leaks",
         "requests": "Requests", "capacity": "Capacity"}
README_SCREENSHOT = ROOT / "docs" / "screenshot.png"  # refreshed only with KVSCOPE_UPDATE_SCREENSHOT=1
START_TIMEOUT_S = 60.0
RENDER_TIMEOUT_MS = 60_000

try:
    from playwright.sync_api import Page, sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sync_playwright is None, reason="the Python package playwright is not installed "
                       "(pip install playwright; no browser download is needed)"),
    pytest.mark.skipif(not CHROMIUM.exists() and shutil.which("chromium") is None,
                       reason=f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, "streamlit exited before it served"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"streamlit did not listen on port {port} within {START_TIMEOUT_S:.0f} s")


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "KVSCOPE_DB": str(ROOT / "sample_runs" / "leaky.db")}
    command = [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.headless", "true",
               "--server.port", str(port), "--browser.gatherUsageStats", "false"]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, server)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=20)


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    assert sync_playwright is not None
    with sync_playwright() as playwright:
        executable = CHROMIUM if CHROMIUM.exists() else Path(str(shutil.which("chromium")))
        browser = playwright.chromium.launch(executable_path=str(executable), args=CHROMIUM_ARGS)
        yield browser.new_page(viewport={"width": 1400, "height": 1000})
        browser.close()


def rendered(page: Page, url: str, title: str) -> None:
    page.goto(url)
    page.get_by_role("heading", name=title).first.wait_for(timeout=RENDER_TIMEOUT_MS)
    page.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=RENDER_TIMEOUT_MS)
    page.locator('[data-testid="stPlotlyChart"]').first.wait_for(timeout=RENDER_TIMEOUT_MS)
    page.wait_for_timeout(1000)  # let plotly lay the charts out before checks and screenshots


@pytest.mark.parametrize("path", list(PAGES), ids=[t for t in PAGES.values()])
def test_every_page_renders_in_a_browser(server_url: str, page: Page, path: str, tmp_path: Path) -> None:
    rendered(page, f"{server_url}/{path}", PAGES[path])
    assert page.locator('[data-testid="stException"]').count() == 0
    assert "Traceback" not in page.content()
    assert page.locator('[data-testid="stPlotlyChart"]').count() >= 1
    if path == "":
        shot = README_SCREENSHOT if os.environ.get("KVSCOPE_UPDATE_SCREENSHOT") else tmp_path / "overview.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000, "the Overview rendered as an (almost) empty page"
