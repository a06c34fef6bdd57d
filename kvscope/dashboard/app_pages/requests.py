"""Requests: a per-request timeline (arrive, admit, prefill chunks, decode, finish or retract), cached tokens."""

from __future__ import annotations

import streamlit as st

from kvscope.dashboard import charts, data
from kvscope.dashboard.frame import selection

PAGE_ROWS = 60

chosen = selection()
st.header("Requests")
requests = data.requests(chosen.path, chosen.run_id, chosen.stamp)
if chosen.running:
    st.caption("A request's record is written when it ends: running requests appear once they finish.")
if requests.empty:
    st.info("No finished requests recorded in this run yet.")
    st.stop()

cols = st.columns(4)
cols[0].metric("requests", f"{len(requests):,}")
cols[1].metric("prompt tokens", f"{int(requests['prompt_len'].sum()):,}")
cols[2].metric("cached tokens", f"{int(requests['cached_tokens'].sum()):,}")
cols[3].metric("retractions", f"{int(requests['num_retractions'].sum()):,}")
statuses = sorted(set(requests["status"]))
chosen_status = st.multiselect("status", statuses, default=statuses, key="requests.status")
shown = requests[requests["status"].isin(chosen_status)]

num_pages = max(1, -(-len(shown) // PAGE_ROWS))
page = int(st.number_input(f"page (of {num_pages}, {PAGE_ROWS} requests each, by arrival)", 1, num_pages, 1,
                           key="requests.page"))
window = shown.iloc[(page - 1) * PAGE_ROWS: page * PAGE_ROWS]
allocs = data.allocs_of_requests(chosen.path, chosen.run_id, chosen.stamp, tuple(window["rid"]))
st.subheader("Timeline")
st.caption("Steps on the x axis: waiting (arrive → admit), prefill (admit → first token; dots are the steps that "
           "allocated prefill chunks), decode (first token → finish); a cross marks a retraction.")
st.plotly_chart(charts.request_timeline_figure(window, allocs), key="requests.timeline")
st.subheader("Cached tokens per request")
st.plotly_chart(charts.cached_tokens_figure(window), key="requests.cached")
st.dataframe(window.drop(columns=["run_id"]), hide_index=True)
