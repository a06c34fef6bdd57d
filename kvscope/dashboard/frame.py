"""The shared frame: which capture and run are shown, the sidebar picker and refresh toggle.

NOTE: the capture is chosen in this order: a link's `?capture=` (when the sidebar lists it),
the sidebar picker (once touched), `-- --db PATH` on the streamlit command line, $KVSCOPE_DB,
the newest *.db under runs/, else sample_runs/. The run: a link's `?run=`, the picker, else
the newest run. The run's status is read once per rerun (Selection.status): the picker's label,
the status line and the pages all show that one.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import streamlit as st

from kvscope.dashboard import data, priority, retained, tenants, url_state
from kvscope.telemetry import CaptureError, display_name, link_name

CAPTURE_DIRS = (Path("runs"), Path("sample_runs"))
PAGES_DIR = Path(__file__).parent / "app_pages"
PAGE_FILES = {
    "Overview": "overview.py",
    "Memory": "memory.py",
    "Tiers": "tiers.py",
    "Radix tree": "tree.py",
    "Evictions": "evictions.py",
    "Leaks": "leaks.py",
    "Requests": "requests.py",
    "Capacity": "capacity.py",
    "Fleet": "fleet.py",
}
STATE_KEY = "kvscope.selection"
CAPTURE_KEY = "kvscope.capture"
RUN_KEY = "kvscope.run"
LABELS_KEY = "kvscope.run_labels"  # the picker's labels at the last rerun
RUNS_OF_KEY = "kvscope.runs_of"  # the capture those labels are of


class Selection(NamedTuple):
    path: str
    run_id: int
    run: Any  # the runs() row: id, label, status, display_status, config, heartbeat_at, error, ...
    stamp: float  # changes whenever the run's data may have changed: the cache key of every read
    live: bool  # the run is running and the refresh toggle is on
    status: str  # the run's status for this whole rerun: the picker, the status line and every page show this one
    tenant: str | None = None  # the sidebar's tenant filter (None: all tenants)

    @property
    def running(self) -> bool:
        return self.status == "running"


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


def run_labels(runs: pd.DataFrame) -> dict[int, str]:
    """The picker's label of each run, from the one status column read this rerun."""
    return {
        int(row.id): f"run {row.id} · {row.label or 'unlabelled'} · {row.display_status}" for row in runs.itertuples()
    }


def capture_options(requested: str | None, found: list[Path]) -> list[str]:
    """The requested capture first, then the ones found; one entry per file however it was
    named (relative or absolute). A URL is kept as written."""
    options: dict[str, str] = {}
    for name in [*([requested] if requested else []), *map(str, found)]:
        options.setdefault(_same_file_key(name), name)
    return list(options.values())


def _same_file_key(name: str) -> str:
    """One key per capture: a file's real path; a URL without its password (what links carry)."""
    return link_name(name) if "://" in name else os.path.realpath(name)


def _listed_as(name: str, options: list[str]) -> str | None:
    """The option naming the same capture as `name`, if any."""
    keys = {_same_file_key(option): option for option in options}
    return keys.get(_same_file_key(name))


def _pick_capture(options: list[str]) -> str:
    linked = url_state.pending("capture")
    if linked is not None:
        listed = _listed_as(linked, options)
        if listed is not None:
            st.session_state[CAPTURE_KEY] = listed
        else:
            url_state.note(
                f"The link's capture {display_name(linked)!r} is not one this dashboard lists: "
                f"showing {display_name(options[0])!r}."
            )
    if st.session_state.get(CAPTURE_KEY) not in options:
        st.session_state[CAPTURE_KEY] = options[0]
    return str(st.sidebar.selectbox("Capture", options, key=CAPTURE_KEY, format_func=display_name))


def _pick_run(path: str, runs: pd.DataFrame) -> Any:
    """NOTE: the labels carry the status, and a keyed selectbox keeps showing the label the
    browser last had when only the labels change (its key is its identity): when they change,
    the choice is set again, which sends the new label. Another capture starts at its newest run."""
    labels = run_labels(runs)
    if st.session_state.get(RUNS_OF_KEY) != path:
        st.session_state.pop(RUN_KEY, None)
        st.session_state[RUNS_OF_KEY] = path
    ids = list(labels)
    linked = url_state.pending("run")
    if linked is not None and linked not in labels:
        url_state.note(
            f"The link's run {linked} is not in this capture (runs: {', '.join(map(str, ids))}): showing run {ids[-1]}."
        )
    chosen = linked if linked in labels else st.session_state.get(RUN_KEY)
    if chosen not in labels:
        chosen = ids[-1]
    if chosen != st.session_state.get(RUN_KEY) or st.session_state.get(LABELS_KEY) != labels:
        st.session_state[RUN_KEY] = chosen
    st.session_state[LABELS_KEY] = labels
    run_id = st.sidebar.selectbox("Run", ids, format_func=labels.__getitem__, key=RUN_KEY)
    return runs[runs["id"] == run_id].iloc[0]


def _status_line(run: Any, status: str) -> None:
    st.sidebar.caption(f"status: **{status}** · level {run.level}")
    error = getattr(run, "error", None)
    if isinstance(error, str) and error and status != "finished":
        st.sidebar.caption(error)


@st.cache_resource(show_spinner=False)
def _yielded_cpu(nice: int) -> int:
    """Once per process (per niceness asked): the dashboard's threads at `nice` (priority.py)."""
    return priority.yield_cpu(nice)


def _yield_cpu() -> None:
    try:
        _yielded_cpu(priority.requested_nice())
    except ValueError as err:
        st.sidebar.error(str(err))


def render_frame() -> Selection | None:
    """The sidebar; returns the selection, or shows one line and returns None when there is none."""
    st.sidebar.title("kvscope")
    _yield_cpu()
    url_state.take_new()
    requested = requested_capture()
    options = capture_options(requested, find_captures())
    if not options:
        st.info(
            "No captures under `runs/` or `sample_runs/`. Record one with `kvscope run --workload "
            "shared-prefix`, or open a file with `streamlit run app.py -- --db PATH`."
        )
        return None
    path = _pick_capture(options)
    try:
        runs = data.runs(path)
    except CaptureError as err:
        st.error(str(err))
        return None
    if runs.empty:
        st.info(f"{display_name(path)}: the capture holds no runs yet.")
        return None
    run = _pick_run(path, runs)
    refresh = st.sidebar.toggle(
        "Live refresh",
        value=True,
        key="kvscope.refresh",
        help="While the run is running, the live panels refresh about every second.",
    )
    status = str(run.display_status)
    _status_line(run, status)
    stamp = _stamp(run)
    tenant = tenants.pick_tenant(_principals(path, int(run.id), stamp))
    url_state.reset(capture=link_name(path), run=int(run.id), tenant=tenant)
    url_state.show_notes()
    chosen = Selection(path, int(run.id), run, stamp, bool(refresh) and status == "running", status, tenant)
    retained.over_bound_line(chosen)
    st.session_state[STATE_KEY] = chosen
    return chosen


def _principals(path: str, run_id: int, stamp: float) -> list[str]:
    """The run's principals for the tenant filter; none when a damaged page of the capture is in
    the way (the pages that read it say so, and the Overview still renders)."""
    try:
        return data.principals(path, run_id, stamp)
    except CaptureError:
        return []


def _stamp(run: Any) -> float:
    return float(run.heartbeat_at or 0.0) + float(run.ended_at or 0.0)


def selection() -> Selection:
    """The selection app.py made for this rerun (pages call this first)."""
    chosen = st.session_state.get(STATE_KEY)
    if chosen is None:
        st.info("Open the app through `streamlit run app.py`.")
        st.stop()
    return chosen
