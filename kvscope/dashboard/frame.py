"""The shared frame: which capture and run are shown, the sidebar picker and refresh toggle.

NOTE: the capture is chosen in this order: the sidebar picker (once touched), `-- --db PATH`
on the streamlit command line, $KVSCOPE_DB, the newest *.db under runs/, else sample_runs/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import streamlit as st

from kvscope.dashboard import data
from kvscope.telemetry import CaptureError

CAPTURE_DIRS = (Path("runs"), Path("sample_runs"))
PAGES_DIR = Path(__file__).parent / "app_pages"
PAGE_FILES = {
    "Overview": "overview.py",
    "Memory": "memory.py",
    "Radix tree": "tree.py",
    "Evictions": "evictions.py",
    "Leaks": "leaks.py",
    "Requests": "requests.py",
    "Capacity": "capacity.py",
}
STATE_KEY = "kvscope.selection"


class Selection(NamedTuple):
    path: str
    run_id: int
    run: Any  # the runs() row: id, label, status, display_status, config, heartbeat_at, ...
    stamp: float  # changes whenever the run's data may have changed: the cache key of every read
    live: bool  # the run is running and the refresh toggle is on

    @property
    def running(self) -> bool:
        return str(self.run.display_status) == "running"


def find_captures(dirs: tuple[Path, ...] = CAPTURE_DIRS) -> list[Path]:
    """Capture files (*.db): the newest folder with any wins (runs/ before sample_runs/),
    each folder's files newest first; the later folders follow."""
    found: list[Path] = []
    for folder in dirs:
        if folder.is_dir():
            found += sorted(folder.glob("*.db"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found


def requested_capture(argv: list[str] | None = None) -> str | None:
    """`--db PATH` after `streamlit run app.py --`, else $KVSCOPE_DB."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--db")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args.db or os.environ.get("KVSCOPE_DB") or None


def _run_label(row: Any) -> str:
    return f"run {row.id} · {row.label or 'unlabelled'} · {row.display_status}"


def _pick_capture(options: list[str]) -> str:
    return str(st.sidebar.selectbox("Capture", options, index=0, key="kvscope.capture"))


def _pick_run(runs: pd.DataFrame) -> Any:
    labels = [_run_label(row) for row in runs.itertuples()]
    index = st.sidebar.selectbox("Run", range(len(labels)), index=len(labels) - 1, format_func=labels.__getitem__,
                                 key="kvscope.run")
    return runs.iloc[int(index)]


def render_frame() -> Selection | None:
    """The sidebar; returns the selection, or shows one line and returns None when there is none."""
    st.sidebar.title("kvscope")
    requested = requested_capture()
    options = list(dict.fromkeys([*([requested] if requested else []), *map(str, find_captures())]))
    if not options:
        st.info("No captures under `runs/` or `sample_runs/`. Record one with `kvscope run --workload "
                "shared-prefix`, or open a file with `streamlit run app.py -- --db PATH`.")
        return None
    path = _pick_capture(options)
    try:
        runs = data.runs(path)
    except CaptureError as err:
        st.error(str(err))
        return None
    if runs.empty:
        st.info(f"{path}: the capture holds no runs yet.")
        return None
    run = _pick_run(runs)
    refresh = st.sidebar.toggle("Live refresh", value=True, key="kvscope.refresh",
                                help="While the run is running, the live panels refresh about every second.")
    st.sidebar.caption(f"status: **{run.display_status}** · level {run.level}")
    stamp = float(run.heartbeat_at or 0.0) + float(run.ended_at or 0.0)
    chosen = Selection(path, int(run.id), run, stamp, bool(refresh) and run.display_status == "running")
    st.session_state[STATE_KEY] = chosen
    return chosen


def selection() -> Selection:
    """The selection app.py made for this rerun (pages call this first)."""
    chosen = st.session_state.get(STATE_KEY)
    if chosen is None:
        st.info("Open the app through `streamlit run app.py`.")
        st.stop()
    return chosen
