"""Requests: latency percentiles (queue, time to first token, end to end), hit rate and tokens/s over
time, a per-request timeline (arrive, admit, prefill chunks, decode, finish or retract). A request is
in the URL (?rid=)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import attached, attached_pages, charts, data, latency, reads, tenants, timing, url_state
from kvscope.dashboard.frame import Selection, selection

PAGE_ROWS = 60
ALL = "(all requests)"
RID_KEY = "requests.rid"


def latency_section(latency_ms: pd.DataFrame) -> None:
    st.subheader("Latency")
    st.caption("**queue** = admit − arrive, **time to first token** = first token − arrive, **end to end** = "
               "finish − arrive, over the requests that reached that stage (aborted, unfinished or in-flight requests "
               "count only for the stages they reached). Percentiles interpolate between requests.")
    table = timing.latency_percentiles(latency_ms)
    st.dataframe(table, hide_index=True, column_config={c: st.column_config.NumberColumn(format="%.1f")
                                                        for c in table.columns if c.endswith("(ms)")})
    st.plotly_chart(latency.latency_figure(latency_ms), key="requests.latency")


def throughput_section(chosen: Selection, clock: timing.Clock | None) -> None:
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    if len(usage) < 2:
        return
    st.subheader("Hit rate and tokens per second over time")
    st.caption("From the usage samples' running totals: the token hit rate so far and over the last five samples, "
               "and prompt tokens (cached or computed) and cached tokens admitted per second over the same window. "
               + (f"Times are {timing.zone_name()}." if clock is not None else "This capture has no clock: seconds "
                  "since its first sample."))
    series = timing.throughput(usage, clock)
    st.plotly_chart(latency.throughput_figure(series, clock is not None), key="requests.throughput")


def pick_request(requests: pd.DataFrame) -> str:
    rids = requests["rid"].astype(str).tolist()
    linked = url_state.pending("rid")
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


def request_rows(requests: pd.DataFrame) -> pd.DataFrame:
    """The requests to show: the one picked, or those with the picked statuses."""
    cols = st.columns([1, 2])
    with cols[0]:
        rid = pick_request(requests)
    if rid != ALL:
        return requests[requests["rid"].astype(str) == rid]
    statuses = sorted(set(requests["status"]))
    chosen_status = cols[1].multiselect("status", statuses, default=statuses, key="requests.status")
    return requests[requests["status"].isin(chosen_status)]


chosen = selection()
st.header("Requests")
if (source := attached.source_of(chosen.run)) is not None:  # a real engine watched by `kvscope attach`
    attached_pages.requests(chosen, source)
    st.stop()
notes = st.container()
requests = data.requests(chosen.path, chosen.run_id, chosen.stamp)
if chosen.running:
    st.caption("A request's record is written when it ends: running requests appear once they finish.")
if requests.empty:
    with notes:
        url_state.show_notes()
    st.info("No finished requests recorded in this run yet.")
    st.stop()
if chosen.tenant is not None:
    requests = tenants.of_tenant(requests, chosen.tenant)
    st.caption(f"Only the requests of tenant **{chosen.tenant}** ({len(requests):,}): pick all tenants in the "
               "sidebar to see every request.")
    if requests.empty:
        with notes:
            url_state.show_notes()
        st.info(f"No finished request of tenant {chosen.tenant} in this run.")
        st.stop()
clock = reads.run_clock(chosen.path, chosen.run_id, chosen.stamp, chosen.run)
latency_ms = timing.latencies(requests)

cols = st.columns(4)
cols[0].metric("requests", f"{len(requests):,}")
cols[1].metric("prompt tokens", f"{int(requests['prompt_len'].sum()):,}")
cols[2].metric("cached tokens", f"{int(requests['cached_tokens'].sum()):,}")
cols[3].metric("retractions", f"{int(requests['num_retractions'].sum()):,}")
latency_section(latency_ms)
throughput_section(chosen, clock)

st.subheader("Requests")
shown = request_rows(requests)
with notes:
    url_state.show_notes()
num_pages = max(1, -(-len(shown) // PAGE_ROWS))
page = int(st.number_input(f"page (of {num_pages}, {PAGE_ROWS} requests each, by arrival)", 1, num_pages, 1,
                           key="requests.page"))
window = shown.iloc[(page - 1) * PAGE_ROWS: page * PAGE_ROWS]
allocs = data.allocs_of_requests(chosen.path, chosen.run_id, chosen.stamp, tuple(window["rid"]))
st.caption("Steps on the x axis: waiting (arrive → admit), prefill (admit → first token; dots are the steps that "
           "allocated prefill chunks), decode (first token → finish); a cross marks a retraction.")
st.plotly_chart(charts.request_timeline_figure(window, allocs), key="requests.timeline")
st.plotly_chart(charts.cached_tokens_figure(window), key="requests.cached")
st.caption("Times are wall-clock " + (timing.zone_name() if clock is not None else "seconds since the first arrival")
           + "; latencies in milliseconds.")
st.dataframe(latency.request_table(window, latency_ms.loc[window.index], clock), hide_index=True)
