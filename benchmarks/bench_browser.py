"""Each dashboard page in a real headless browser: the seconds from asking for the page to its settled
state, cold, on one capture (issue 41: every page <= 2 s cold at 100 M events, once in a real browser).

    .venv/bin/python benchmarks/bench_browser.py CAPTURE [PAGE ...] [--rounds N] [--no-write]

CAPTURE is a file or a database URL; PAGEs are the dashboard's pages (all of them when none is named).
Each round of each page gets a fresh `streamlit run app.py` (so its caches, Streamlit's and the store's,
are cold) and a fresh browser tab. The server's first page, on a small sample capture (sample_runs/
leaky.db, through the link's `capture=`), is untimed: it imports the dashboard's modules, as any server
has once its first viewer came. Then the tab opens `/<page>?capture=CAPTURE` and the clock runs until the
page is settled: its heading is there, Streamlit's "running" widget is gone, no spinner or skeleton is
left and every Plotly chart has drawn its SVG, and all of that has held for SETTLE_HOLD_S (the figure is
when that stable stretch began, not its end). The heading's own time is printed beside it.

Needs Debian's `chromium` and the Python `playwright` package (as tests/dashboard/test_browser.py; no
browser download). The browser renders on this machine, so a busy machine stretches the figures: the
1-minute load average is printed and written with them. Sets rows in `## bench_browser` of
benchmarks/RESULTS.md, named after the capture's file (or database) and page.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

from _results import Figure, this_run, write_figures

ROOT = Path(__file__).resolve().parents[1]
WARM_UP_CAPTURE = ROOT / "sample_runs" / "leaky.db"
CHROMIUM = Path(os.environ.get("KVSCOPE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
PAGES = {  # NOTE: URL path -> the page's heading
    "": "Overview",
    "memory": "Memory",
    "tiers": "Tiers",
    "tree": "Radix tree",
    "evictions": "Evictions",
    "leaks": "Leaks",
    "requests": "Requests",
    "capacity": "Capacity",
}
POLL_S = 0.05
SETTLE_HOLD_S = 1.5
PAGE_TIMEOUT_S = 600.0
START_TIMEOUT_S = 60.0
TARGET_S = 2.0
ABOUT = (
    "Each dashboard page in a real headless browser (Chromium through Playwright): seconds from asking for the "
    "page to its settled state (heading, no running widget, spinner or skeleton, every chart drawn), cold: a "
    "fresh server and tab per render. A small sample capture's rows beside a large one's show what the browser, "
    "Streamlit's front end and Plotly cost with almost no data."
)
STATE_JS = """() => {
  const q = (s) => document.querySelectorAll(s);
  const charts = [...q('[data-testid="stPlotlyChart"]')];
  return {
    headings: [...q('h1, h2')].map((h) => h.innerText.trim()),
    running: q('[data-testid="stStatusWidget"]').length,
    spinners: q('[data-testid="stSpinner"], [data-testid="stSkeleton"]').length,
    undrawn: charts.filter((c) => !c.querySelector('.main-svg')).length,
    exceptions: q('[data-testid="stException"]').length,
  };
}"""


@contextmanager
def dashboard(capture: str) -> Iterator[str]:
    """A fresh dashboard server on `capture`; yields its URL; stopped on the way out."""
    from kvscope.dashboard.launch import dashboard_on

    try:
        with dashboard_on(capture, start_timeout_s=START_TIMEOUT_S) as (url, _server):
            yield url
    except RuntimeError as err:
        raise SystemExit(f"bench_browser: {err}") from None


def has_heading(state: dict[str, Any], heading: str) -> bool:
    return any(h.startswith(heading) for h in state["headings"])


def is_settled(state: dict[str, Any], heading: str) -> bool:
    return has_heading(state, heading) and not state["running"] and not state["spinners"] and not state["undrawn"]


def settle(tab: Any, url: str, heading: str) -> tuple[float, float, dict[str, Any]]:
    """(seconds to the settled state, seconds to the heading, the last state) of opening `url`."""
    start = time.perf_counter()
    tab.goto(url, wait_until="commit")
    heading_s = stable_since = None
    while True:
        state = tab.evaluate(STATE_JS)
        now = time.perf_counter()
        if heading_s is None and has_heading(state, heading):
            heading_s = now - start
        if is_settled(state, heading):
            stable_since = now if stable_since is None else stable_since
            if now - stable_since >= SETTLE_HOLD_S:
                return stable_since - start, heading_s or 0.0, state
        else:
            stable_since = None
        if now - start > PAGE_TIMEOUT_S:
            raise SystemExit(f"bench_browser: {url} did not settle within {PAGE_TIMEOUT_S:.0f} s (last: {state})")
        time.sleep(POLL_S)


def one_render(browser: Any, capture: str, path: str) -> tuple[float, float, dict[str, Any]]:
    with dashboard(capture) as url:
        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            settle(tab, f"{url}/?capture={quote(str(WARM_UP_CAPTURE))}", "Overview")  # NOTE: untimed
            tab.close()
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            return settle(tab, f"{url}/{path}?capture={quote(capture)}", PAGES[path])
        finally:
            tab.close()


def capture_name(capture: str) -> str:
    return capture.rsplit("/", 1)[-1].split("?")[0] if "://" in capture else Path(capture).name


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("capture", help="a capture file or database URL")
    parser.add_argument("pages", nargs="*", help=f"pages to time (all: {', '.join(p or 'overview' for p in PAGES)})")
    parser.add_argument("--rounds", type=int, default=1, help="cold renders of each page, rounds alternating (1)")
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    args = parser.parse_args()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("bench_browser: the Python package playwright is not installed (pip install playwright)", file=sys.stderr)
        return 2
    executable = CHROMIUM if CHROMIUM.exists() else Path(shutil.which("chromium") or CHROMIUM)
    if not executable.exists():
        print(f"bench_browser: no Chromium at {CHROMIUM} (apt-get install -y chromium)", file=sys.stderr)
        return 2
    if "://" not in args.capture and not Path(args.capture).is_file():
        print(f"bench_browser: no capture file {args.capture}", file=sys.stderr)
        return 2
    paths = ["" if p == "overview" else p for p in args.pages] or list(PAGES)
    unknown = [p for p in paths if p not in PAGES]
    if unknown:
        print(
            f"bench_browser: unknown pages {unknown} (pages: overview, {', '.join(list(PAGES)[1:])})", file=sys.stderr
        )
        return 2
    capture = args.capture if "://" in args.capture else str(Path(args.capture).resolve())
    settled: dict[str, list[float]] = {p: [] for p in paths}
    loads: dict[str, list[float]] = {p: [] for p in paths}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(executable), args=CHROMIUM_ARGS)
        try:
            for round_no in range(args.rounds):
                order = paths if round_no % 2 == 0 else paths[::-1]
                for path in order:
                    settled_s, heading_s, state = one_render(browser, capture, path)
                    load = os.getloadavg()[0]
                    settled[path].append(settled_s)
                    loads[path].append(load)
                    errors = f"; {state['exceptions']} exceptions shown" if state["exceptions"] else ""
                    said = f"settled {settled_s:.2f} s (heading {heading_s:.2f} s); load {load:.1f}{errors}"
                    print(f"{PAGES[path]}: {said}", flush=True)
        finally:
            browser.close()
    name = capture_name(capture)
    figures = []
    for path in paths:
        median = statistics.median(settled[path])
        rounds = ", ".join(f"{s:.2f}" for s in settled[path])
        spread = f" (rounds {rounds})" if len(settled[path]) > 1 else ""
        value = f"{median:.2f} s to settled{spread}; load {min(loads[path]):.1f}-{max(loads[path]):.1f}"
        met = "met" if median <= TARGET_S else "not met"
        figures.append(Figure(f"{name}, {PAGES[path]} page, cold", value, f"≤ {TARGET_S:g} s", met))
    if not args.no_write:
        write_figures("bench_browser", ABOUT, figures, this_run("cpu"))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
