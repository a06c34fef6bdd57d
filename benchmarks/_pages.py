"""Shared by the benchmark scripts that time the dashboard: each page of the real app through AppTest,
cold and warm.

NOTE: what a timing is
    the capture    KVSCOPE_DB = `db` (a file path or a store URL); the app opens its newest run
    a page         opened directly (as from its link), the app frame and run picker included
    warm-up        one untimed render of every page first (the page's modules imported, as in a
                   running dashboard)
    cold           st.cache_data and st.cache_resource cleared first (the store, the leak report,
                   the page's reads, chart building and Streamlit's own work)
    warm           the same page again, from the caches
    rounds         alternate the page order (forward, backward, ...); the result is the medians
Streamlit is imported on the first call, so a bench imports this module without it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parent.parent


def open_page(page: str) -> AppTest:
    """The page opened directly (as from its link), the app frame included."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    if page == "overview":
        return at.run()
    return at.switch_page(f"kvscope/dashboard/app_pages/{page}.py").run()


def time_pages(
    db: str, pages: Sequence[str], rounds: int, check: Callable[[str, AppTest], None] | None = None
) -> dict[str, tuple[float, float]]:
    """Page -> (cold, warm) median seconds, in `pages`' order (see the module NOTE). Every timed
    render must raise nothing; `check(page, at)` may assert more of it."""
    import streamlit as st

    os.environ["KVSCOPE_DB"] = db
    os.chdir(ROOT)
    for page in pages:  # NOTE: untimed: the first render of each page imports its modules
        open_page(page)
    times: dict[str, dict[str, list[float]]] = {page: {"cold": [], "warm": []} for page in pages}
    for round_no in range(rounds):
        for page in pages if round_no % 2 == 0 else pages[::-1]:
            for kind in ("cold", "warm"):
                if kind == "cold":
                    st.cache_data.clear()
                    st.cache_resource.clear()  # the store and the leak report too
                start = time.perf_counter()
                at = open_page(page)
                times[page][kind].append(time.perf_counter() - start)
                assert not at.exception, [e.value for e in at.exception]
                if check is not None:
                    check(page, at)
    return {page: (statistics.median(t["cold"]), statistics.median(t["warm"])) for page, t in times.items()}
