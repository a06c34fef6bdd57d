"""Cached reads. One cached store per capture path; every read is a `st.cache_data` function
keyed by (path, run_id, stamp, ...) — `stamp` moves whenever a running run flushes, so a
finished run's reads are computed once and a running run's follow it.

NOTE: no SQL here: every read is a kvscope.telemetry read (a Capture method or a derived read)
or a kvscope.debug report."""

from __future__ import annotations

import atexit
import json
from typing import Any, NamedTuple

import pandas as pd
import streamlit as st

from kvscope import telemetry
from kvscope.dashboard import gpu
from kvscope.debug import LeakReport, Replay, ReportState, build_report, checks_report, stored_report
from kvscope.telemetry import Capture, tenant_of
from kvscope.telemetry.derived import usage_at as usage_at_step

LIVE_TTL_S = 1.0  # the run list: status changes must show within a refresh
CACHE_TTL_S = 600.0  # everything else is keyed by the stamp; the TTL only bounds memory
MAX_POINTS = 600


@st.cache_resource(show_spinner=False)
def open_capture(path: str) -> Capture:
    """The one store per capture (read-only). A CaptureError is raised, not cached. When the dashboard
    stops, a capture whose runs all closed is folded back into one file (its -wal and -shm go)."""
    capture = Capture(path)
    atexit.register(capture.close_and_settle)
    return capture


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def runs(path: str) -> pd.DataFrame:
    return open_capture(path).runs()


def run_config(run: Any) -> dict[str, Any]:
    try:
        config = json.loads(run.config or "{}")
    except (TypeError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def cache_kind(run: Any) -> str:
    """The run's cache kind from its config ("radix" when the config does not say)."""
    cache = run_config(run).get("engine", {}).get("cache", {})
    return str(cache.get("kind", "radix")) if isinstance(cache, dict) else "radix"


def pool_config(run: Any) -> dict[str, Any]:
    pool = run_config(run).get("engine", {}).get("pool", {})
    return pool if isinstance(pool, dict) else {}


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def usage(path: str, run_id: int, stamp: float, max_points: int = MAX_POINTS) -> pd.DataFrame:
    return open_capture(path).usage(run_id, max_points)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def latest_usage(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    """The last usage row and the row about RATE_WINDOW_S seconds before it (for rates)."""
    return open_capture(path).latest_usage(run_id)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def usage_at(path: str, run_id: int, stamp: float, step: int) -> pd.DataFrame:
    """The exact usage row of the last sampled step at or before `step` (not downsampled)."""
    return usage_at_step(open_capture(path), run_id, step)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def recent_evictions(path: str, run_id: int, stamp: float, since_step: int) -> pd.DataFrame:
    return telemetry.recent_evictions(open_capture(path), run_id, since_step)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def leak_checks(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    return open_capture(path).leak_checks(run_id)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def event_counts(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    return open_capture(path).event_counts(run_id)


class Retained(NamedTuple):
    """What retention did to a run's events (None: nothing dropped) and whether the capture is past its
    size bound now (OverBound.text, else None)."""

    first_step: int | None
    dropped_events: int
    over_bound: str | None


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def retained(path: str, run_id: int, stamp: float) -> Retained:
    capture = open_capture(path)
    kept = capture.run_retention(run_id)
    if kept is None:
        return Retained(None, 0, None)
    dropped, over = int(kept.first_seq), capture.over_bounds().get(run_id)
    return Retained(int(kept.first_step) if dropped else None, dropped, None if over is None else over.text())


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def step_range(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    return open_capture(path).step_range(run_id)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner="Rebuilding the tree…")
def tree_at(path: str, run_id: int, step: int, stamp: float) -> pd.DataFrame:
    return open_capture(path).tree_at(run_id, step)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def eviction_summary(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    return telemetry.eviction_summary(open_capture(path), run_id)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def evictions_over_steps(path: str, run_id: int, stamp: float, max_points: int = MAX_POINTS) -> pd.DataFrame:
    return telemetry.evictions_over_steps(open_capture(path), run_id, max_points)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner="Joining evictions with later matches…")
def eviction_log(path: str, run_id: int, stamp: float, limit: int, offset: int) -> pd.DataFrame:
    return telemetry.eviction_log(open_capture(path), run_id, limit, offset)


# NOTE: the Requests page reads a run's requests by page and by aggregate, never all rows at once
# (a long serve session records hundreds of thousands); `tenant` None: every tenant


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def request_principals(path: str, run_id: int, stamp: float) -> list[str]:
    return open_capture(path).request_principals(run_id)


def _principals_of(path: str, run_id: int, stamp: float, tenant: str | None) -> list[str] | None:
    if tenant is None:
        return None
    return [p for p in request_principals(path, run_id, stamp) if tenant_of(p) == tenant]


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def request_totals(path: str, run_id: int, stamp: float, tenant: str | None) -> pd.DataFrame:
    return open_capture(path).request_totals(run_id, _principals_of(path, run_id, stamp, tenant))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def request_times(path: str, run_id: int, stamp: float, tenant: str | None) -> pd.DataFrame:
    """The monotonic times of every request (arrive, admit, first token, finish): the latencies."""
    return open_capture(path).request_rows(
        run_id,
        principals=_principals_of(path, run_id, stamp, tenant),
        columns=["arrive_t", "admit_t", "first_token_t", "finish_t"],
        ordered=False,
    )


# NOTE: more requests (of the tenant shown): the Requests page reads its latencies from the histograms the writer
# kept, where the capture has them (schema version 12), not from every request's times (20,000 requests' times:
# 0.18 s cold on the 100 M-event capture, 100,000: 0.94 s); past it the box is drawn without points anyway
# (latency.BOX_POINTS_MAX)
EXACT_LATENCIES_MAX = 20_000


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def request_latency_histograms(path: str, run_id: int, stamp: float, tenant: str | None) -> pd.DataFrame | None:
    """The latency histograms the writer kept (None: the run has none, read request_times)."""
    return open_capture(path).request_latency_histograms(run_id, _principals_of(path, run_id, stamp, tenant))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def request_ids(path: str, run_id: int, stamp: float, tenant: str | None) -> list[str]:
    frame = open_capture(path).request_rows(
        run_id, principals=_principals_of(path, run_id, stamp, tenant), columns=["rid"]
    )
    return [str(r) for r in frame["rid"]]


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def request_page(
    path: str,
    run_id: int,
    stamp: float,
    tenant: str | None,
    statuses: tuple[str, ...] | None,
    rid: str | None,
    limit: int,
    offset: int,
    newest_first: bool = False,
) -> pd.DataFrame:
    return open_capture(path).request_rows(
        run_id,
        principals=_principals_of(path, run_id, stamp, tenant),
        statuses=statuses,
        rid=rid,
        limit=limit,
        offset=offset,
        newest_first=newest_first,
    )


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def principals(path: str, run_id: int, stamp: float) -> list[str]:
    return telemetry.run_principals(open_capture(path), run_id)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def visibility_changes(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    return telemetry.visibility_changes(open_capture(path), run_id)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def reuse_by_principal(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    return telemetry.reuse_by_principal(open_capture(path), run_id)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def snapshot_steps(path: str, run_id: int, stamp: float) -> list[int]:
    return open_capture(path).snapshot_steps(run_id)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def latest_snapshot(path: str, run_id: int, stamp: float) -> tuple[int | None, pd.DataFrame]:
    """The run's latest tree snapshot as stored (step None and an empty table when it has none)."""
    capture = open_capture(path)
    steps = capture.snapshot_steps(run_id)
    if not steps:
        return None, pd.DataFrame()
    return steps[-1], capture.tree_at(run_id, steps[-1])


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def allocs_of_requests(path: str, run_id: int, stamp: float, rids: tuple[str, ...]) -> pd.DataFrame:
    return telemetry.allocs_of_requests(open_capture(path), run_id, rids)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def in_flight(path: str, run_id: int, stamp: float, since_step: int, step: int) -> pd.DataFrame:
    return telemetry.in_flight(open_capture(path), run_id, since_step, step)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def running_lengths(path: str, run_id: int, stamp: float, step: int) -> pd.DataFrame:
    return telemetry.running_lengths(open_capture(path), run_id, step)


@st.cache_resource(show_spinner=False, max_entries=8)
def _report_state(path: str, run_id: int, started_at: float) -> ReportState:
    """The paused ledger replay of one run (keyed by its start time too, so a capture file
    replaced under the same path starts afresh)."""
    return ReportState(Replay(run_id))


@st.cache_resource(ttl=CACHE_TTL_S, max_entries=16, show_spinner="Replaying the slot ledger (about 7 µs per event)…")
def leak_report(path: str, run_id: int, stamp: float) -> LeakReport:
    """The debugger's report (a dataclass, not a frame: it is the debugger's own record): the
    one stored at close when it still describes the run, else a replay that resumes where the
    last one on this run stopped (a running run replays only its new events).

    NOTE: a resource, not cache_data: pages only read it, and unpickling a report of 60k leaks
    on every view cost 0.4 s."""
    stored = stored_report(open_capture(path), run_id)
    if stored is not None:
        return stored
    known = runs(path)
    started = known[known.id == run_id]["started_at"]
    state = _report_state(path, run_id, float(started.iloc[0]) if not started.empty else 0.0)
    return build_report(path, run_id, state=state)


@st.cache_resource(ttl=CACHE_TTL_S, max_entries=16, show_spinner=False)
def verdict_report(path: str, run_id: int, stamp: float) -> LeakReport:
    """The report the Overview's verdict is read from (kvscope.debug.verdict, as `kvscope check`):
    the one stored with the run when it still describes it; a closed run's whole report (leak_report:
    only the ledger can say clean, and a leak found before an interrupted or crashed run stopped is a
    leak, as check says); else, for a run still running, its leak checks alone (never a replay: the
    Overview must stay cheap on a live run)."""
    stored = stored_report(open_capture(path), run_id)
    if stored is not None:
        return stored
    known = runs(path)
    run = known[known.id == run_id]
    if not run.empty and str(run.iloc[0].display_status) != "running" and str(run.iloc[0].level) == "full":
        return leak_report(path, run_id, stamp)
    return checks_report(path, run_id, capture=open_capture(path))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def attach_counters(path: str, run_id: int, stamp: float) -> dict[str, int] | None:
    """The attach loop's counters (the run's `reports` row of kind "attach", stored when
    `kvscope attach` ends); None when the run stored none (still running, or not attached)."""
    from kvscope.dashboard.attached import counters_of

    row = open_capture(path).stored_report(run_id, "attach")
    return None if row is None else counters_of(row.body)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def gpus() -> pd.DataFrame:
    return gpu.probe()


@st.cache_data(ttl=CACHE_TTL_S, show_spinner="Replaying the request stream for the hit-rate curve…")
def capacity_curves(
    path: str, run_id: int, started_at: float, page_size: int, sharing: tuple[str, ...] = ("global",)
) -> tuple[dict[str, pd.DataFrame], int]:
    """The one-pass hit-rate curves of the run's request stream (regenerated from its config),
    by sharing rule ("global"; "isolated": keys per user), in the order of `sharing`; and the
    stream's prompt tokens. Raises ValueError when the stream cannot be rebuilt.

    NOTE: keyed by the run's start, not the read stamp: the stream comes from the config alone, so
    a live run's curve is computed once, not on every refresh of every tab (100k requests: ~20 s)."""
    from kvscope.dashboard.charts import curve_frame
    from kvscope.planning import load_requests, one_pass_curve

    requests = load_requests(path, run_id)
    frames = {}
    for rule in sharing:
        curve = one_pass_curve(requests, page_size, isolated=rule == "isolated")
        frames[rule] = curve_frame(*curve.breakpoints(), curve.num_prompt_tokens)
    return frames, int(sum(r.prompt_len for r in requests))


def page_waste(lengths: pd.DataFrame, page_size: int) -> pd.DataFrame:
    """Per running request: tokens, slots held (whole pages) and wasted tail slots.

    NOTE: slots_held counts a request's shared prefix as its own: summed over requests it counts
    a prefix once per request that uses it, so a total of the pool's slots comes from
    slots_of_running (the pool's own terms), never from this sum."""
    out = lengths.copy()
    out["seq_len"] = out["seq_len"].fillna(0).astype(int)
    out["slots_held"] = -(-out["seq_len"] // page_size) * page_size
    out["wasted_slots"] = out["slots_held"] - out["seq_len"]
    return out


class RunningSlots(NamedTuple):
    """Full-pool slots in use by running requests at one step, each slot counted once."""

    in_tree: int  # the locked (protected) prefixes they share: a prefix used by many counts once
    own: int  # their slots outside the tree (total - free - evictable - protected)
    total: int  # the pool's size

    @property
    def held(self) -> int:
        return self.in_tree + self.own


def slots_of_running(usage_row: pd.Series) -> RunningSlots:
    """From the pool's own terms at a step: what running requests hold, shared slots once."""
    total, free = int(usage_row["full_total"]), int(usage_row["full_available"])
    evictable, protected = int(usage_row["full_evictable"]), int(usage_row["full_protected"])
    return RunningSlots(protected, total - free - evictable - protected, total)
