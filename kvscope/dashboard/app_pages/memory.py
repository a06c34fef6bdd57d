"""Memory: each pool's terms over time (full and SWA side by side), token vs page occupancy."""

from __future__ import annotations

import streamlit as st

from kvscope.dashboard import charts, data
from kvscope.dashboard.frame import selection

chosen = selection()
st.header("Memory")
usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
if usage.empty:
    st.info("No usage samples in this run yet.")
    st.stop()

st.subheader("Pools over time")
st.caption("Stacked per pool: **free** (the allocator's free list), **evictable** (cached, unlocked), **protected** "
           "(cached, locked by a running request) and **held by requests** (the rest: slots running requests hold "
           "outside the tree; with no request running, anything left here is missing, a leak). Downsampled in SQL "
           f"to at most {data.MAX_POINTS} points (each bucket keeps its maxima).")
st.plotly_chart(charts.memory_timeline_figure(usage), key="memory.timeline")

st.subheader("Token vs page occupancy")
pool = data.pool_config(chosen.run)
page_size = int(pool.get("page_size", 1) or 1)
if page_size == 1:
    st.caption("Page size 1: every slot holds a token, no slot is wasted.")
    st.stop()
busiest = int(usage.loc[usage["num_running"].astype(int).idxmax(), "step"])
bounds = data.step_range(chosen.path, chosen.run_id, chosen.stamp).iloc[0]
step = st.slider("step", int(bounds["lo"]), int(bounds["hi"]), busiest, key="memory.step",
                 help="defaults to the step with the most running requests")
waste = data.page_waste(data.running_lengths(chosen.path, chosen.run_id, chosen.stamp, step), page_size)
at_step = data.usage_at(chosen.path, chosen.run_id, chosen.stamp, step)
cols = st.columns(4)
cols[0].metric("page size", f"{page_size} tokens")
if not at_step.empty:
    slots = data.slots_of_running(at_step.iloc[0])
    cols[1].metric("running requests' slots", f"{slots.held:,} of {slots.total:,}",
                   help="each slot counted once, from the pool's own terms: the locked prefixes they share in the tree "
                        f"({slots.in_tree:,}, a prefix used by many requests counts once) + their slots outside the "
                        f"tree ({slots.own:,}, whole pages; any leaked slots count here too)")
    cols[2].metric("of which in the tree (locked)", f"{slots.in_tree:,}",
                   help="tree slots locked by running requests: a prefix several requests share is held once")
cols[3].metric("wasted slots", f"{int(waste['wasted_slots'].sum()):,}",
               help="the unused tail of each running request's last page")
st.caption("Tree nodes are page-aligned, so the waste is in running requests' last pages: a request of length L "
           f"holds ceil(L / {page_size}) pages. L = the hit of its latest prefix match + the tokens allocated for it "
           "since (an estimate from the events). A bar counts the request's shared prefix as its own, so the bars "
           "add up to more than the slots above.")
if waste.empty:
    st.caption(f"No request was running at step {step}.")
else:
    st.plotly_chart(charts.page_waste_figure(waste), key="memory.waste")
