"""Overview: the pools now, hit rates, requests, evictions, the last leak check, the GPU. Live."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import charts, data
from kvscope.dashboard.frame import Selection, selection

LIVE_EVERY_S = 1.0


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def pool_metrics(last: pd.Series) -> None:
    usage = last.to_frame().T
    for pool in charts.pools_of(usage):
        terms = charts.pool_terms(usage, pool).iloc[0]
        total = terms["total"] or 1.0
        cols = st.columns(5)
        cols[0].metric(f"{pool}: used", f"{int(terms['total'] - terms['free']):,}",
                       help=f"of {int(terms['total']):,} tokens ({(terms['total'] - terms['free']) / total:.0%})")
        cols[1].metric(f"{pool}: evictable", f"{int(terms['evictable']):,}")
        cols[2].metric(f"{pool}: protected", f"{int(terms['protected']):,}")
        cols[3].metric(f"{pool}: held by requests", f"{int(terms['requests']):,}")
        cols[4].metric(f"{pool}: free", f"{int(terms['free']):,}")


def traffic_metrics(chosen: Selection, rows: pd.DataFrame) -> None:
    last, first = rows.iloc[-1], rows.iloc[0]
    rates = charts.hit_rates(last)
    seconds = float(last["t_mono"]) - float(first["t_mono"])
    recent = data.recent_evictions(chosen.path, chosen.run_id, chosen.stamp, int(first["step"])).iloc[0]
    cols = st.columns(6)
    cols[0].metric("hit rate: tokens", _pct(rates.token_weighted),
                   help="token-weighted: cached prompt tokens / prompt tokens (the ratio of sums)")
    cols[1].metric("hit rate: requests", _pct(rates.request_weighted),
                   help="request-weighted: requests that hit any cached prefix / requests")
    cols[2].metric("running / waiting", f"{int(last['num_running'])} / {int(last['num_waiting'])}")
    per_s = "–" if seconds <= 0 else f"{int(recent['num_evictions']) / seconds:.1f}"
    cols[3].metric("evictions / s", per_s, help=f"over the last {seconds:.1f} s of the run "
                   f"({int(recent['evicted_tokens']):,} tokens); {int(last['cum_evicted_tokens']):,} tokens in all")
    cols[4].metric("retractions", f"{int(last['cum_retractions']):,}")
    step, verdict = leak_verdict(chosen)
    cols[5].metric("last leak check" if step is None else f"leak check, step {step}", verdict)


def leak_verdict(chosen: Selection) -> tuple[int | None, str]:
    """The last idle leak check: its step and 'ok' or 'FAILED: <pools>'."""
    checks = data.leak_checks(chosen.path, chosen.run_id, chosen.stamp)
    if checks.empty:
        return None, "none yet"
    last = checks[checks["step"] == checks["step"].max()]
    bad = last[~last["ok"].astype(bool)]
    return int(last["step"].iloc[0]), "ok" if bad.empty else f"FAILED: {', '.join(bad['pool'])}"


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
    if rows.empty:
        st.info("No usage samples yet: the run has not finished its first step.")
        return
    pool_metrics(rows.iloc[-1])
    traffic_metrics(chosen, rows)
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    st.plotly_chart(charts.live_usage_figure(usage), key="overview.usage")
    gpu_panel()


chosen = selection()
st.header("Overview")
st.fragment(live_panel, run_every=LIVE_EVERY_S if chosen.live else None)()
