"""End to end in a real headless browser: `streamlit run app.py` on a sample capture, every page
loads without an exception; the Overview's screenshot goes to docs/screenshot.png (the README's).
On the leaking sample, the numbers Overview and Leaks state; a copied URL reopens the same step;
on a capture being written, the run picker and the status line agree when the run ends; the Tiers page
draws both tiers of a hiradix run.

Needs Debian's `chromium` (/usr/bin/chromium) and the Python `playwright` package (never
`playwright install`: no browser download). Without them the test skips and says which is missing.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from kvscope.dashboard.launch import dashboard_on
from kvscope.telemetry import PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder
from tests.dashboard import test_probe_capture
from tests.dashboard.conftest import ROOT

CHROMIUM = Path(os.environ.get("KVSCOPE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGES = {
    "": "Overview",
    "memory": "Memory",
    "tree": "Radix tree",
    "evictions": "Evictions",
    "leaks": "Leaks",
    "requests": "Requests",
    "capacity": "Capacity",
}
README_SCREENSHOT = ROOT / "docs" / "screenshot.png"  # refreshed only with KVSCOPE_UPDATE_SCREENSHOT=1
START_TIMEOUT_S = 60.0
RENDER_TIMEOUT_MS = 60_000
SETTLED_JS = """(title) => {
  const q = (s) => [...document.querySelectorAll(s)];
  const running = '[data-testid="stStatusWidget"], [data-testid="stSpinner"], [data-testid="stSkeleton"]';
  const charts = q('[data-testid="stPlotlyChart"]');
  return q('h1, h2').some((h) => h.innerText.trim().startsWith(title)) && q(running).length === 0
    && charts.length > 0 && charts.every((c) => c.querySelector('.main-svg') !== null);
}"""

try:
    from playwright.sync_api import Page, sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sync_playwright is None,
        reason="the Python package playwright is not installed (pip install playwright; no browser download is needed)",
    ),
    pytest.mark.skipif(
        not CHROMIUM.exists() and shutil.which("chromium") is None,
        reason=f"no Chromium at {CHROMIUM} (apt-get install -y chromium)",
    ),
]


@contextmanager
def streamlit_server(db: Path) -> Iterator[str]:
    with dashboard_on(db, start_timeout_s=START_TIMEOUT_S) as (url, _server):
        yield url


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with streamlit_server(ROOT / "sample_runs" / "leaky.db") as url:
        yield url


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
    settled(page, title)


def settled(page: Page, title: str) -> None:
    """The page's heading is there, nothing runs (Streamlit's status widget, a spinner, a skeleton) and
    every Plotly chart has drawn, and still is a second later (a rerun that had not started yet)."""
    for _ in range(2):
        page.wait_for_function(SETTLED_JS, arg=title, timeout=RENDER_TIMEOUT_MS)
        page.wait_for_timeout(1000)  # let plotly lay the charts out before checks and screenshots


def main_text(page: Page) -> str:
    return page.locator('[data-testid="stMain"]').inner_text()


def step_shown(page: Page) -> int:
    return int(page.locator('[data-testid="stSlider"] input[type="range"]').first.input_value())


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


def test_overview_and_leaks_state_the_leaking_samples_numbers(server_url: str, page: Page) -> None:
    """leaky.db: the idle check at step 38 finds 40 full-pool tokens missing; the ledger names 23 root
    causes and 1 consequence; the lock on node 31 is 44 slots when locked and 20 in the report."""
    rendered(page, f"{server_url}/", "Overview")
    overview = main_text(page)
    assert "leak check failed at step 38" in overview
    assert "40 tokens missing" in overview
    rendered(page, f"{server_url}/leaks", "Leaks")
    leaks = main_text(page)
    assert "leak" in leaks and "step 16" in leaks  # the verdict and the bisected onset
    assert "23 root causes, 1 consequence " in leaks
    assert "Node 31: the injection record says 44 slots" in leaks and "The report says 20" in leaks


def sideways_overflow(page: Page, which: int) -> int:
    """How far the page's `which`-th table (-1: the last) scrolls sideways, in px."""
    tables = page.locator('[data-testid="stDataFrame"]')
    table = tables.nth(which if which >= 0 else tables.count() + which)
    table.scroll_into_view_if_needed()
    scroller = table.locator(".dvn-scroller").first
    scroller.wait_for(timeout=RENDER_TIMEOUT_MS)
    return int(scroller.evaluate("e => e.scrollWidth - e.clientWidth"))


@pytest.mark.parametrize(
    ("path", "title", "which", "name"),
    [
        ("leaks", "Leaks", 0, "culprit table"),
        ("requests", "Requests", 0, "latency table"),
        ("evictions", "Evictions", -1, "eviction log"),
    ],
)
def test_the_tables_fit_without_scrolling_sideways(
    server_url: str, page: Page, path: str, title: str, which: int, name: str
) -> None:
    rendered(page, f"{server_url}/{path}", title)
    overflow = sideways_overflow(page, which)
    assert overflow <= 1, f"the {name} scrolls sideways by {overflow} px"


def test_a_copied_url_reopens_the_same_step(server_url: str, page: Page) -> None:
    rendered(page, f"{server_url}/tree?step=20", "Radix tree")
    assert step_shown(page) == 20 and "Step 20:" in main_text(page)
    copied = page.url
    query = parse_qs(urlparse(copied).query)
    assert urlparse(copied).path == "/tree" and query["step"] == ["20"] and query["run"] == ["1"]
    assert query["capture"] == [str(ROOT / "sample_runs" / "leaky.db")]
    fresh = page.context.browser.new_page(viewport={"width": 1400, "height": 1000})  # a new session, as a colleague
    try:
        rendered(fresh, copied, "Radix tree")
        assert step_shown(fresh) == 20 and "Step 20:" in main_text(fresh)
    finally:
        fresh.close()
    rendered(page, f"{server_url}/tree?step=oops", "Radix tree")
    assert step_shown(page) == 38 and "The link's step 'oops' is not a whole number" in main_text(page)


def test_a_culprits_link_opens_its_request(server_url: str, page: Page) -> None:
    rendered(page, f"{server_url}/leaks", "Leaks")
    page.get_by_role("link", name="request mt-c0009-t0 on Requests").click()
    settled(page, "Requests")
    assert parse_qs(urlparse(page.url).query)["rid"] == ["mt-c0009-t0"]
    picked = page.locator('[data-testid="stSelectbox"]').filter(has_text="request").locator("input").first
    assert picked.input_value() == "mt-c0009-t0"


def run_picker_label(page: Page) -> str:
    return page.locator('[data-testid="stSidebar"] input[aria-label="Run"]').input_value()


def test_the_run_picker_and_the_status_line_agree_when_a_run_ends(tmp_path: Path, page: Page) -> None:
    db = tmp_path / "live.db"
    recorder = SQLRecorder(db, level="full", label="live")
    try:
        for step in range(3):
            recorder.step = step
            recorder.usage(
                UsageSample(
                    step, PoolTerms(100, 60, 30, 10), None, 4, 2, 2, step, 10 * step, 5 * step, step, step, 0, 0
                )
            )
        recorder.flush()
        with streamlit_server(db) as url:
            rendered(page, f"{url}/", "Overview")
            status = page.locator('[data-testid="stSidebar"]').get_by_text("status:")
            assert run_picker_label(page) == "run 1 · live · running" and "running" in status.inner_text()
            recorder.close()
            status.filter(has_text="finished").wait_for(timeout=RENDER_TIMEOUT_MS)  # the live panel reruns the app
            page.wait_for_timeout(1000)
            assert run_picker_label(page) == "run 1 · live · finished"
    finally:
        recorder.close()


def test_live_pages_follow_a_growing_run_without_a_reload(tmp_path: Path, page: Page) -> None:
    """The Radix tree (follow newest) and Evictions pages rerun by themselves while the run records."""
    from tests.dashboard.test_live import grow

    recorder = SQLRecorder(tmp_path / "live.db", level="full", label="live")
    try:
        grow(recorder, range(3))
        with streamlit_server(tmp_path / "live.db") as url:
            page.goto(f"{url}/evictions")
            evictions = page.locator('[data-testid="stMetric"]').filter(has_text="evictions").first
            evictions.filter(has_text="3").wait_for(timeout=RENDER_TIMEOUT_MS)
            grow(recorder, range(3, 6))
            evictions.filter(has_text="6").wait_for(timeout=RENDER_TIMEOUT_MS)  # no reload: the page reran itself
            page.goto(f"{url}/tree")
            page.get_by_text("Step 5:").first.wait_for(timeout=RENDER_TIMEOUT_MS)
            grow(recorder, range(6, 9))
            page.get_by_text("Step 8:").first.wait_for(timeout=RENDER_TIMEOUT_MS)
    finally:
        recorder.close()


def test_the_tiers_page_draws_both_tiers_in_a_browser(tmp_path: Path, page: Page) -> None:
    from tests.dashboard.test_tiers import record_hiradix

    with streamlit_server(record_hiradix(tmp_path / "hiradix.db")) as url:
        rendered(page, f"{url}/tiers", "Tiers")
        assert page.locator('[data-testid="stException"]').count() == 0 and "Traceback" not in page.content()
        charts = page.locator('[data-testid="stPlotlyChart"]')
        assert charts.count() == 3
        for i in range(3):  # plotly drew each one: its lines are paths in the figure's svg
            assert charts.nth(i).locator(".scatterlayer .trace path.js-line").count() >= 1, i
        text = main_text(page)
        assert "device tokens allocated" in text and "host tokens allocated" in text and "one tier" not in text


def console_errors(page: Page, url: str, title: str) -> list[str]:
    """The browser console's errors while a page renders (plotly reports SVG attributes it could
    not place there, e.g. '<text> attribute y: Expected length, "-Infinity"')."""
    errors: list[str] = []

    def keep(message: Any) -> None:
        if message.type == "error" and "Failed to load resource" not in message.text:
            errors.append(message.text)

    page.on("console", keep)
    try:
        rendered(page, url, title)
        page.wait_for_timeout(1000)
    finally:
        page.remove_listener("console", keep)
    return errors


@pytest.fixture(scope="module")
def probe_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_probe_capture's capture shaped like the vLLM probe's (two steps, finish-only requests)."""
    return Path(test_probe_capture.probe_capture.__wrapped__(tmp_path_factory))


def test_memory_and_requests_log_no_infinity_errors(probe_db: Path, tmp_path: Path, page: Page) -> None:
    """A probe capture (two steps) and an attached one: plotly put a step axis's title at
    y = -Infinity when every tick sat on the plot's edges."""
    from tests.dashboard.test_attached import vllm_like

    for db in (probe_db, vllm_like(tmp_path / "vllm.db")):
        with streamlit_server(db) as url:
            for path, title in (("memory", "Memory"), ("requests", "Requests")):
                errors = console_errors(page, f"{url}/{path}", title)
                assert not [e for e in errors if "Infinity" in e or "NaN" in e], (db.name, path, errors)


def test_node_details_fit_a_1440_px_window_and_a_click_picks_a_node(server_url: str, page: Page) -> None:
    wide = page.context.browser.new_page(viewport={"width": 1440, "height": 1000})
    try:
        rendered(wide, f"{server_url}/tree?step=20", "Radix tree")
        assert sideways_overflow(wide, 0) <= 1, "the node details scroll sideways"
        picker = wide.locator('[data-testid="stSelectbox"]').filter(has_text="node (").locator("input").first
        before = picker.input_value()
        slices = wide.locator('[data-testid="stPlotlyChart"] g.slice')
        slices.nth(1).click()  # NOTE: the first slice is the root; the second a subtree below it
        wide.wait_for_function(
            "before => new URLSearchParams(location.search).get('node') !== before",
            arg=before,
            timeout=RENDER_TIMEOUT_MS,
        )
        settled(wide, "Radix tree")
        node = parse_qs(urlparse(wide.url).query)["node"][0]
        assert node != before and picker.input_value() == node  # NOTE: the table is a canvas: no text to read
    finally:
        wide.close()
