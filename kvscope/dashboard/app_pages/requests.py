"""Requests: latency percentiles (queue, time to first token, end to end), hit rate and tokens/s over
time, a per-request timeline (arrive, admit, prefill chunks, decode, finish or retract). A request is
in the URL (?rid=). A source with no request records shows the running and waiting counts it reports;
one without arrival times says so in place of the latencies."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from kvscope import telemetry
from kvscope.dashboard import capability, charts, data, latency, live, reads, reported, retained, timing, url_state
from kvscope.dashboard.frame import Selection, selection

PAGE_ROWS = 60
ORDERS = ("newest first", "oldest first")
IN_FLIGHT_WINDOW_STEPS = 5_000  # NOTE: a live run's in-flight requests are read from this many recent steps' events
PICK_FROM_MAX = 2_000  # NOTE: more requests: the picker is a box to type an id in
ALL = "(all requests)"
RID_KEY = "requests.rid"
RID_TEXT_KEY = "requests.rid_text"
# NOTE: fixed widths (about 600 px) so the table fits beside the sidebar, not cut off at the right edge
LATENCY_COLUMNS = {
    "latency": st.column_config.TextColumn("latency", width=150),
    "requests": st.column_config.NumberColumn("requests", width=80),
    **{
        f"{name} (ms)": st.column_config.NumberColumn(f"{name} (ms)", format="%.1f", width=90)
        for name in ("p50", "p90", "p99", "max")
    },
}
# NOTE: the table's default columns fit a 1440 px window: who, what it asked, what it got, when, how long
COMPACT_COLUMNS: tuple[str, ...] = ("rid", "principal", "status", "prompt_len", "cached_tokens", "output_len")
COMPACT_COLUMNS += ("num_retractions", *(f"{name} (ms)" for name in timing.LATENCIES))
NARROW_COLUMNS = {
    "prompt_len": st.column_config.NumberColumn("prompt", width=70, help="prompt tokens"),
    "cached_tokens": st.column_config.NumberColumn("cached", width=70, help="prompt tokens the cache matched"),
    "output_len": st.column_config.NumberColumn("output", width=70, help="generated tokens"),
    "num_retractions": st.column_config.NumberColumn("retracted", width=70, help="times retracted for memory"),
    **{
        f"{name} (ms)": st.column_config.NumberColumn(f"{name} (ms)", width=110, format="%.1f")
        for name in timing.LATENCIES
    },
}
TIME_COLUMNS = {
    name: st.column_config.DatetimeColumn(name, format=timing.DATETIME_COLUMN_FORMAT)
    for name in ("arrive", "admit", "first token", "finish", "retract")
}


def latency_section(latency_ms: pd.DataFrame) -> None:
    st.subheader("Latency")
    st.caption(
        "**queue** = admit − arrive, **time to first token** = first token − arrive, **end to end** = "
        "finish − arrive, over the requests that reached that stage (aborted, unfinished or in-flight requests "
        "count only for the stages they reached). Percentiles interpolate between requests."
    )
    table = timing.latency_percentiles(latency_ms)
    st.dataframe(table, hide_index=True, column_config=LATENCY_COLUMNS)
    st.plotly_chart(latency.latency_figure(latency_ms), key="requests.latency")


def histogram_latency_section(histograms: pd.DataFrame) -> None:
    """latency_section for more than data.EXACT_LATENCIES_MAX requests: from the capture's latency histograms."""
    st.subheader("Latency")
    st.caption(
        "**queue** = admit − arrive, **time to first token** = first token − arrive, **end to end** = "
        "finish − arrive, over the requests that reached that stage. Percentiles and boxes are read from "
        f"latency histograms kept as the requests were recorded: each within {telemetry.MAX_RELATIVE_ERROR:.2%} "
        "(buckets 1.1% wide); max is exact."
    )
    table = timing.histogram_percentiles(histograms)
    st.dataframe(table[list(LATENCY_COLUMNS)], hide_index=True, column_config=LATENCY_COLUMNS)
    st.plotly_chart(latency.latency_box_figure(table), key="requests.latency")


def latencies_of(chosen: Selection, num_requests: int) -> None:
    """The latency section: exact up to data.EXACT_LATENCIES_MAX requests, from the histograms past it."""
    if num_requests > data.EXACT_LATENCIES_MAX:
        histograms = data.request_latency_histograms(chosen.path, chosen.run_id, chosen.stamp, chosen.tenant)
        if histograms is not None:
            histogram_latency_section(histograms)
            return
    latency_section(timing.latencies(data.request_times(chosen.path, chosen.run_id, chosen.stamp, chosen.tenant)))


def throughput_section(chosen: Selection, clock: timing.Clock | None) -> None:
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    if len(usage) < 2:
        return
    st.subheader("Hit rate and tokens per second over time")
    st.caption(
        "From the usage samples' running totals: the token hit rate so far and over the last five samples, "
        "and prompt tokens (cached or computed) and cached tokens admitted per second over the same window. "
        + (
            f"Times are {timing.zone_name()}."
            if clock is not None
            else "This capture has no clock: seconds since its first sample."
        )
    )
    series = timing.throughput(usage, clock)
    st.plotly_chart(latency.throughput_figure(series, clock is not None), key="requests.throughput")


def lookups_section(chosen: Selection) -> None:
    """Why prefix lookups stopped, where the source records it (the probe names a reason per lookup)."""
    stops = reads.lookup_stops(chosen.path, chosen.run_id, chosen.stamp)
    if stops.empty:
        return
    st.subheader("Why prefix lookups stopped")
    st.caption(
        "Each prefix lookup of the run, by the reason its source recorded for where the hit ended; hit and "
        "missed tokens are summed over those lookups."
    )
    st.dataframe(stops, hide_index=True)


def pick_request(path: str, run_id: int, stamp: float, tenant: str | None, num_requests: int) -> str:
    """ALL, or the rid of one request: a list to pick from, or a box to type an id in when the
    run has more than PICK_FROM_MAX requests (a list of 300k ids is no use in a browser)."""
    linked = url_state.pending("rid")
    if num_requests > PICK_FROM_MAX:
        if linked is not None:
            st.session_state[RID_TEXT_KEY] = linked
        typed = st.text_input(
            f"request (one of {num_requests:,}: type its id)", key=RID_TEXT_KEY, help="empty: every request"
        ).strip()
        if typed and data.request_page(path, run_id, stamp, tenant, None, typed, 1, 0).empty:
            url_state.note(f"The request {typed!r} is not in this run: showing all requests.")
            typed = ""
        url_state.publish(rid=typed or None)
        return typed or ALL
    rids = data.request_ids(path, run_id, stamp, tenant)
    if linked is not None:
        if linked in set(rids):
            st.session_state[RID_KEY] = linked
        else:
            url_state.note(f"The link's request {linked!r} is not in this run: showing all requests.")
    if st.session_state.get(RID_KEY) not in (ALL, *rids):
        st.session_state[RID_KEY] = ALL
    rid = str(st.selectbox("request", [ALL, *rids], key=RID_KEY, help="one request, or all of them"))
    url_state.publish(rid=None if rid == ALL else rid)
    return rid


def request_filter(chosen: Selection, totals: pd.DataFrame) -> tuple[str | None, tuple[str, ...] | None, int]:
    """(the request picked, or None; the statuses picked, or None for all; how many match)."""
    cols = st.columns([1, 2])
    with cols[0]:
        rid = pick_request(chosen.path, chosen.run_id, chosen.stamp, chosen.tenant, int(totals["num_requests"].sum()))
    if rid != ALL:
        return rid, None, 1
    statuses = [str(s) for s in totals["status"]]
    picked = cols[1].multiselect("status", statuses, default=statuses, key="requests.status")
    counts = dict(zip(statuses, totals["num_requests"].astype(int), strict=True))
    return None, (None if set(picked) == set(statuses) else tuple(picked)), sum(counts[s] for s in picked)


def panel(chosen: Selection) -> None:
    """Totals, latency, throughput and the table of requests (refreshed while the run is running)."""
    notes = st.container()
    totals = data.request_totals(chosen.path, chosen.run_id, chosen.stamp, None)
    if chosen.running:
        in_flight_section(chosen)
    if totals.empty:
        with notes:
            url_state.show_notes()
        st.info("No finished requests recorded in this run yet.")
        return
    if chosen.tenant is not None:
        totals = data.request_totals(chosen.path, chosen.run_id, chosen.stamp, chosen.tenant)
        num_of_tenant = int(totals["num_requests"].sum()) if not totals.empty else 0
        st.caption(
            f"Only the requests of tenant **{chosen.tenant}** ({num_of_tenant:,}): pick all tenants in the "
            "sidebar to see every request."
        )
        if totals.empty:
            with notes:
                url_state.show_notes()
            st.info(f"No finished request of tenant {chosen.tenant} in this run.")
            return
    clock = reads.run_clock(chosen.path, chosen.run_id, chosen.stamp, chosen.run)
    num_requests = int(totals["num_requests"].sum())

    cols = st.columns(4)
    cols[0].metric("requests", f"{num_requests:,}")
    cols[1].metric("prompt tokens", f"{int(totals['prompt_tokens'].sum()):,}")
    cols[2].metric("cached tokens", f"{int(totals['cached_tokens'].sum()):,}")
    cols[3].metric("retractions", f"{int(totals['retractions'].sum()):,}")
    caps = capability.of(chosen)
    if caps.has("latencies"):
        latencies_of(chosen, num_requests)
    else:
        capability.cannot(caps, "latencies")
    throughput_section(chosen, clock)
    lookups_section(chosen)
    table_section(chosen, totals, notes, clock)


def in_flight_section(chosen: Selection) -> None:
    """A live run's requests that have not ended, newest first: a request's record (its lengths and
    latencies, the table below) is written when it ends, so these come from its arrive and admit
    events, read over the last IN_FLIGHT_WINDOW_STEPS steps."""
    caps = capability.of(chosen)
    if caps.lacks("in_flight"):
        capability.cannot(caps, "in_flight")
        return
    last = data.step_range(chosen.path, chosen.run_id, chosen.stamp)["hi"].iloc[0]
    if pd.isna(last):
        return
    last = int(last)
    since = max(0, last - IN_FLIGHT_WINDOW_STEPS)
    frame = data.in_flight(chosen.path, chosen.run_id, chosen.stamp, since, last)
    running = int((frame["state"] == "running").sum())
    st.subheader(f"In flight at step {last:,}: {running:,} running, {len(frame) - running:,} waiting")
    st.caption(
        f"Requests that arrived in the last {IN_FLIGHT_WINDOW_STEPS:,} steps and have not finished, newest first; "
        "their record (lengths, latencies) joins the table below when they end."
    )
    if not frame.empty:
        shown = frame.rename(columns={"arrive_step": "arrived (step)", "admit_step": "admitted (step)"})
        if shown["principal"].isna().all():
            shown = shown.drop(columns=["principal"])
        st.dataframe(shown, hide_index=True, key="requests.in_flight")


def missing_moments(window: pd.DataFrame) -> str:
    """What the timeline cannot draw because the source records no such moment (one sentence)."""
    known = {c: c in window and bool(window[c].notna().any()) for c in ("admit_step", "first_token_step")}
    if not known["admit_step"] and not known["first_token_step"]:
        return (
            " This source records only when each request finished (and any retraction): each request is a "
            "dot at its finish step."
        )
    if not known["first_token_step"]:
        return " This source records no first token: an admitted request is one bar from admit to finish."
    return ""


def table_section(chosen: Selection, totals: pd.DataFrame, notes: Any, clock: timing.Clock | None) -> None:
    st.subheader("Requests")
    rid, statuses, num_shown = request_filter(chosen, totals)
    with notes:
        url_state.show_notes()
    num_pages = max(1, -(-num_shown // PAGE_ROWS))
    cols = st.columns([1, 2])
    # NOTE: a live run opens on its newest requests (page 1 follows them as they finish); a closed one on its first
    order = cols[1].radio(
        "order", ORDERS, index=0 if chosen.running else 1, horizontal=True, key=f"requests.order.{chosen.running}"
    )
    page = int(
        cols[0].number_input(
            f"page (of {num_pages}, {PAGE_ROWS} requests each, by arrival)", 1, num_pages, 1, key="requests.page"
        )
    )
    window = data.request_page(
        chosen.path,
        chosen.run_id,
        chosen.stamp,
        chosen.tenant,
        statuses,
        rid,
        PAGE_ROWS,
        (page - 1) * PAGE_ROWS,
        newest_first=order == ORDERS[0],
    )
    allocs = data.allocs_of_requests(chosen.path, chosen.run_id, chosen.stamp, tuple(window["rid"]))
    st.caption(
        "Steps on the x axis: waiting (arrive → admit), prefill (admit → first token; dots are the steps that "
        "allocated prefill chunks), decode (first token → finish); a cross marks a retraction."
        + missing_moments(window)
    )
    st.plotly_chart(charts.request_timeline_figure(window, allocs), key="requests.timeline")
    st.plotly_chart(charts.cached_tokens_figure(window), key="requests.cached")
    st.caption(
        "Times are wall-clock "
        + (timing.zone_name() if clock is not None else "seconds since the first arrival")
        + "; latencies in milliseconds."
    )
    table = latency.request_table(window, timing.latencies(window), clock)
    if not st.toggle("all columns", key="requests.all_columns", help="every stored column: steps, each moment's time"):
        table = table[[c for c in table.columns if c in COMPACT_COLUMNS or c in ("arrive", "arrive (s)")]]
    columns = {**NARROW_COLUMNS, **(TIME_COLUMNS if clock is not None else {})}
    st.dataframe(table, hide_index=True, column_config=columns)


chosen = selection()
st.header("Requests")
retained.dropped_line(chosen)
caps = capability.of(chosen)
capability.source_header(chosen, caps)
if caps.has("requests"):
    live.follow(panel, "requests")
else:  # NOTE: the counts the engine reports, per scrape
    capability.cannot(caps, "ownership")
    reported.request_counts(chosen)
