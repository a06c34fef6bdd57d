"""Overview: the leak verdict, the pools now, hit rates, requests, evictions, the GPU. Live."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from kvscope.dashboard import attached, attached_pages, charts, data
from kvscope.dashboard.frame import Selection, selection
from kvscope.dashboard.verdict import leak_verdict, protected_help, run_seconds, show_verdict
from kvscope.debug import LeakReport

LIVE_EVERY_S = 1.0


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def verdict_panel(chosen: Selection) -> None:
    checks = data.leak_checks(chosen.path, chosen.run_id, chosen.stamp)
    show_verdict(leak_verdict(data.verdict_report(chosen.path, chosen.run_id, chosen.stamp), checks))


def pool_metrics(last: pd.Series, checks: pd.DataFrame, report: LeakReport) -> None:
    """Each pool's total and its terms; with no request running, what is outside the free list
    and the tree is missing (leaked), not held."""
    usage = last.to_frame().T
    idle = int(last["num_running"]) == 0
    for pool in charts.pools_of(usage):
        terms = charts.pool_terms(usage, pool).iloc[0]
        total, used = int(terms["total"]), int(terms["total"] - terms["free"] - terms["evictable"])
        cols = st.columns(6)
        cols[0].metric(f"{pool}: total", f"{total:,}", help="the pool's size in token slots")
        cols[1].metric(f"{pool}: used", f"{used:,}", help=f"{used / (total or 1):.0%} of {total:,} slots: total - free "
                       "- evictable (SGLang's kv_used_tokens), the protected slots plus those held outside the tree")
        cols[2].metric(f"{pool}: evictable", f"{int(terms['evictable']):,}", help="cached in the tree, unlocked")
        cols[3].metric(f"{pool}: protected", f"{int(terms['protected']):,}",
                       help=protected_help(pool, int(last["step"]), int(last["num_running"]), checks, report))
        if idle:
            cols[4].metric(f"{pool}: missing", f"{int(terms['requests']):,}",
                           help="no request is running, so every slot should be free or cached: these are neither "
                                "(the leak check's imbalance)")
        else:
            cols[4].metric(f"{pool}: held by requests", f"{int(terms['requests']):,}",
                           help="slots running requests hold outside the tree (plus any leaked ones)")
        cols[5].metric(f"{pool}: free", f"{int(terms['free']):,}")
    st.caption(f"Request pool: {int(last['req_total'] - last['req_available']):,} of {int(last['req_total']):,} "
               "rows in use.")


def recent_eviction_metric(column: Any, chosen: Selection, rows: pd.DataFrame) -> None:
    """A live run: the rate over its recent window (at most RATE_WINDOW_S), labelled so."""
    last, first = rows.iloc[-1], rows.iloc[0]
    window_s = float(last["t_mono"]) - float(first["t_mono"])
    recent = data.recent_evictions(chosen.path, chosen.run_id, chosen.stamp, int(first["step"])).iloc[0]
    rate = "–" if window_s <= 0 else f"{int(recent['num_evictions']) / window_s:.1f}"
    column.metric(f"evictions / s (last {window_s:.0f} s)", rate,
                  help=f"{int(recent['num_evictions']):,} evictions ({int(recent['evicted_tokens']):,} tokens) in "
                       f"the last {window_s:.1f} s; {int(last['cum_evicted_tokens']):,} tokens in all")


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


def traffic_metrics(chosen: Selection, run: Any, rows: pd.DataFrame) -> None:
    last = rows.iloc[-1]
    rates = charts.hit_rates(last)
    cols = st.columns(5)
    cols[0].metric("hit rate: tokens", _pct(rates.token_weighted),
                   help="token-weighted: cached prompt tokens / prompt tokens (the ratio of sums)")
    cols[1].metric("hit rate: requests", _pct(rates.request_weighted),
                   help="request-weighted: requests that hit any cached prefix / requests")
    cols[2].metric("running / waiting", f"{int(last['num_running'])} / {int(last['num_waiting'])}")
    if str(run["display_status"]) == "running":
        recent_eviction_metric(cols[3], chosen, rows)
    else:
        whole_run_eviction_metric(cols[3], chosen, run, last)
    cols[4].metric("retractions", f"{int(last['cum_retractions']):,}")


def gpu_panel() -> None:
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
    chosen = selection()
    fresh = data.runs(chosen.path)
    run = fresh[fresh["id"] == chosen.run_id].iloc[0]
    if chosen.live and run["display_status"] != "running":
        st.rerun()  # the run ended: rerun the page once, which stops the refreshing
    stamp = float(run["heartbeat_at"] or 0.0) + float(run["ended_at"] or 0.0)
    chosen = chosen._replace(stamp=stamp)
    rows = data.latest_usage(chosen.path, chosen.run_id, chosen.stamp)
    st.caption(f"run {chosen.run_id} · **{run['display_status']}**" + (" · refreshing every second"
                                                                        if chosen.live else ""))
    verdict_panel(chosen)
    if rows.empty:
        st.info("No usage samples yet: the run has not finished its first step.")
        return
    pool_metrics(rows.iloc[-1], data.leak_checks(chosen.path, chosen.run_id, chosen.stamp),
                 data.verdict_report(chosen.path, chosen.run_id, chosen.stamp))
    traffic_metrics(chosen, run, rows)
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    st.plotly_chart(charts.live_usage_figure(usage), key="overview.usage")
    gpu_panel()


chosen = selection()
st.header("Overview")
if attached.source_of(chosen.run) is not None:  # a real engine watched by `kvscope attach`
    st.fragment(attached_pages.overview_panel, run_every=LIVE_EVERY_S if chosen.live else None)()
    st.stop()
st.fragment(live_panel, run_every=LIVE_EVERY_S if chosen.live else None)()
