"""One cold render of each dashboard page through AppTest (as benchmarks/_pages.py opens them),
printed as each finishes: for a capture so large that bench_dashboard.py's rounds (a warm-up render
of every page, then cold and warm renders) do not fit the time at hand.

    .venv/bin/python benchmarks/cold_pages.py CAPTURE PAGE [PAGE ...]    (CAPTURE: a file or a database URL)

Every kvscope.dashboard module is imported and the first page rendered once, untimed; then each page
once with Streamlit's caches cleared (cold), with the 1-minute load average beside it. It writes no
figures: add them to RESULTS.md with _results.py, naming this command.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    sys.path.insert(0, str(ROOT))
    import streamlit as st
    from _pages import open_page

    import kvscope.dashboard as dashboard

    for module in pkgutil.walk_packages(dashboard.__path__, "kvscope.dashboard."):
        if ".app_pages." not in module.name:
            importlib.import_module(module.name)
    os.environ["KVSCOPE_DB"] = sys.argv[1]
    os.chdir(ROOT)
    pages = sys.argv[2:]
    start = time.perf_counter()
    open_page(pages[0])
    print(f"warm-up render of {pages[0]}: {time.perf_counter() - start:.2f} s", flush=True)
    for page in pages:
        st.cache_data.clear()
        st.cache_resource.clear()
        start = time.perf_counter()
        at = open_page(page)
        cold = time.perf_counter() - start
        errors = [e.value for e in at.exception]
        print(f"{page}: cold {cold:.2f} s; load {os.getloadavg()[0]:.1f}; exceptions {errors}", flush=True)


if __name__ == "__main__":
    main()
