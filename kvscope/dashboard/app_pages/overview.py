"""Overview: the leak verdict, the pools now, hit rates, requests, evictions, the GPU. Live.
Each section renders what the run's source provides (capability.of) and says in one line what it
cannot show."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from kvscope.dashboard import capability, charts, data, live, reads, reported, retained, x_axis
from kvscope.dashboard.frame import Selection, selection
from kvscope.dashboard.verdict import attached_verdict, leak_verdict, protected_help, run_seconds, show_verdict
from kvscope.debug import LeakReport
from kvscope.telemetry.capabilities import Capabilities


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def verdict_panel(chosen: Selection, caps: Capabilities) -> None:
    if caps.lacks("leak_checks"):  # NOTE: kvscope cannot balance this source's pool: never "clean"
        verdict = attached_verdict()
        st.info("\n\n".join([f"**{verdict.title}**", *verdict.lines]))
        return
    checks = data.leak_checks(chosen.path, chosen.run_id, chosen.stamp)
    show_verdict(leak_verdict(data.verdict_report(chosen.path, chosen.run_id, chosen.stamp), checks))


def pool_metrics(last: pd.Series, checks: pd.DataFrame, report: LeakReport, caps: Capabilities) -> None:
    """Each pool's total and its terms; with no request running, what is outside the free list
    and the tree is missing (leaked), not held. Evictable and protected only where the source
    splits them out."""
    usage = last.to_frame().T
    idle = int(last["num_running"]) == 0
    unit = "token slots" if caps.has("slots") else f"tokens ({caps.unit} x their size)"
    for pool in charts.pools_of(usage):
        terms = charts.pool_terms(usage, pool).iloc[0]
        total, used = int(terms["total"]), int(terms["total"] - terms["free"] - terms["evictable"])
        cols = iter(st.columns(6))
        next(cols).metric(f"{pool}: total", f"{total:,}", help=f"the pool's size in {unit}")
        next(cols).metric(
            f"{pool}: used",
            f"{used:,}",
            help=f"{used / (total or 1):.0%} of {total:,}: total - free "
            "- evictable (SGLang's kv_used_tokens), the protected ones plus those held outside the tree",
        )
        if caps.has("usage.split"):
            next(cols).metric(f"{pool}: evictable", f"{int(terms['evictable']):,}", help="cached, unused")
        if caps.has("locks"):
            next(cols).metric(
                f"{pool}: protected",
                f"{int(terms['protected']):,}",
                help=protected_help(pool, int(last["step"]), int(last["num_running"]), checks, report),
            )
        if idle:
            next(cols).metric(
                f"{pool}: missing",
                f"{int(terms['requests']):,}",
                help=f"no request is running, so all {caps.unit} should be free or cached: these are "
                "neither (held by nobody: what the leak check reports)",
            )
        else:
            next(cols).metric(
                f"{pool}: held by requests",
                f"{int(terms['requests']):,}",
                help=f"{caps.unit} running requests hold outside the cache (plus any leaked ones)",
            )
        next(cols).metric(f"{pool}: free", f"{int(terms['free']):,}")
        if caps.has("locks") and int(terms["protected"]) and not int(last["num_running"]):
            # NOTE: said on the page, not only in the tooltip: locked tokens with nothing running look like a leak
            why = protected_help(pool, int(last["step"]), 0, checks, report)
            st.caption(f"**{pool}: {int(terms['protected']):,} protected with no request running**: {why}.")
    if caps.has("slots"):
        st.caption(
            f"Request pool: {int(last['req_total'] - last['req_available']):,} of {int(last['req_total']):,} "
            "rows in use."
        )
    capability.cannot(caps, "usage.split", "locks")


def recent_eviction_metric(column: Any, chosen: Selection, rows: pd.DataFrame) -> None:
    """A live run: the rate over its recent window (at most RATE_WINDOW_S), labelled so."""
    last, first = rows.iloc[-1], rows.iloc[0]
    window_s = float(last["t_mono"]) - float(first["t_mono"])
    recent = data.recent_evictions(chosen.path, chosen.run_id, chosen.stamp, int(first["step"])).iloc[0]
    rate = "–" if window_s <= 0 else f"{int(recent['num_evictions']) / window_s:.1f}"
    column.metric(
        f"evictions / s (last {window_s:.0f} s)",
        rate,
        help=f"{int(recent['num_evictions']):,} evictions ({int(recent['evicted_tokens']):,} tokens) in "
        f"the last {window_s:.1f} s; {int(last['cum_evicted_tokens']):,} tokens in all",
    )


def whole_run_eviction_metric(column: Any, chosen: Selection, run: Any, last: pd.Series) -> None:
    """A run that is not running: its count, and the average over its wall-clock length."""
    tokens = int(last["cum_evicted_tokens"])
    if run["level"] != "full":
        column.metric("evicted tokens (whole run)", f"{tokens:,}", help="recorded at level summary: no events")
        return
    counts = data.event_counts(chosen.path, chosen.run_id, chosen.stamp)
    count = int(counts.loc[counts["kind"] == "evict", "count"].sum())
    seconds = run_seconds(run)
    average = f"; {count / seconds:.1f} per second on average over its {seconds:.1f} s" if seconds else ""
    column.metric("evictions (whole run)", f"{count:,}", help=f"{tokens:,} tokens evicted in the whole run{average}")


def traffic_metrics(chosen: Selection, run: Any, rows: pd.DataFrame, caps: Capabilities) -> None:
    last = rows.iloc[-1]
    rates = charts.hit_rates(last)
    cols = st.columns(5)
    cols[0].metric(
        "hit rate: tokens",
        _pct(rates.token_weighted),
        help="token-weighted: cached prompt tokens / prompt tokens (the ratio of sums)",
    )
    cols[1].metric(
        "hit rate: requests",
        _pct(rates.request_weighted),
        help="request-weighted: requests that hit any cached prefix / requests",
    )
    cols[2].metric("running / waiting", f"{int(last['num_running'])} / {int(last['num_waiting'])}")
    if caps.lacks("evictions"):  # NOTE: e.g. the SGLang probe at level summary: its tree methods stay unpatched
        cols[3].metric("evictions", "–", help=caps.cannot_show("evictions"))
    elif str(run["display_status"]) == "running":
        recent_eviction_metric(cols[3], chosen, rows)
    else:
        whole_run_eviction_metric(cols[3], chosen, run, last)
    cols[4].metric("retractions", f"{int(last['cum_retractions']):,}")


def gpu_panel(caps: Capabilities) -> None:
    if caps.lacks("gpu"):
        capability.cannot(caps, "gpu")
        return
    gpus = data.gpus()
    if gpus.empty:
        st.caption("No GPU visible to pynvml on this machine: GPU memory and utilization are not shown.")
        return
    for row in gpus.itertuples():
        cols = st.columns(3)
        cols[0].metric(f"GPU {row.index}", str(row.name))
        cols[1].metric("memory", f"{row.memory_used_mib:,} / {row.memory_total_mib:,} MiB")
        cols[2].metric("utilization", f"{row.utilization_pct}%")


def live_panel() -> None:
    """The Overview's sections (a fragment: it refreshes while the run is running)."""
    chosen = live.refreshed(selection())
    caps = capability.of(chosen)
    st.caption(f"run {chosen.run_id} · **{chosen.status}**" + (" · refreshing every second" if chosen.live else ""))
    capability.source_header(chosen, caps)
    verdict_panel(chosen, caps)
    if caps.has("attach_loop"):
        reported.counters_panel(chosen)
    rows = data.latest_usage(chosen.path, chosen.run_id, chosen.stamp)
    if rows.empty:
        st.info(
            "No usage samples yet: the run has not finished its first step."
            if caps.has("ownership")
            else "No scrape of the engine's /metrics recorded yet."
        )
        return
    if caps.has("ownership"):
        pool_metrics(
            rows.iloc[-1],
            data.leak_checks(chosen.path, chosen.run_id, chosen.stamp),
            data.verdict_report(chosen.path, chosen.run_id, chosen.stamp),
            caps,
        )
        traffic_metrics(chosen, chosen.run, rows, caps)
        usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
        clock = reads.run_clock(chosen.path, chosen.run_id, chosen.stamp, chosen.run)
        _, x = x_axis.pick(usage, clock, "overview.x_axis")
        figure = live.usage_chart(chosen.path, chosen.run_id, chosen.stamp, x, clock)
        st.plotly_chart(figure, key="overview.usage")
    else:  # NOTE: an engine's own figures (its /metrics): NULL where it exports nothing
        reported.pool_panel(chosen, caps, rows.iloc[-1])
        reported.traffic_panel(chosen, caps, rows.iloc[-1])
    gpu_panel(caps)


chosen = selection()
st.header("Overview")
retained.dropped_line(chosen)
live.fragment(live_panel, chosen.live)
