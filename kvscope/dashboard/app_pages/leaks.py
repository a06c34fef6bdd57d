"""Leaks: the memory debugger's report — the invariant terms with the onset, culprits and their slots."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import charts, data
from kvscope.dashboard.frame import selection
from kvscope.debug import render_text

MAX_ROWS = 1000  # culprits shipped to the browser
MAX_TEXT_LEAKS = 100

chosen = selection()
st.header("Leaks")
if chosen.running:
    st.caption("The run is still running: the report covers what has been flushed so far.")
report = data.leak_report(chosen.path, chosen.run_id, chosen.stamp)
if report.stored_at is not None:
    st.caption(f"The report stored with the capture when the run closed ({report.through_seq + 1:,} events replayed).")
elif report.level == "full":
    st.caption(f"Replayed from the capture's {report.through_seq + 1:,} events just now (the run stored no report, "
               "or it no longer matches).")

cols = st.columns(4)
cols[0].metric("verdict", "clean" if report.clean else "LEAKS")
cols[1].metric("idle leak checks", f"{report.checks_run}")
cols[2].metric("first failed check", "–" if report.first_failure_step is None else f"step {report.first_failure_step}")
cols[3].metric("onset", "–" if report.onset_step is None else f"step {report.onset_step}",
               help="the first step at which the slot ledger's invariants break (bisected)")
if report.note:
    st.info(report.note)
for message in report.first_failure:
    st.error(message)

checks = data.leak_checks(chosen.path, chosen.run_id, chosen.stamp)
usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
st.subheader("Invariant terms over time")
st.caption("At each idle check, available + evictable + protected + held + uncached must equal the pool's total. "
           "The dotted line is, per step, the slots outside the free list and the tree (running requests' tokens, "
           "plus any leak): at idle it must come back to zero.")
st.plotly_chart(charts.leak_terms_figure(checks, usage, report.onset_step, report.first_failure_step),
                key="leaks.terms")

st.subheader("Culprits")
if not report.leaks:
    st.success("No orphaned slots, double frees, held locks or reads of freed slots.")
else:
    roots = len(report.root_leaks)
    st.caption(f"{roots:,} root causes, {len(report.leaks) - roots:,} consequences (a later leak touching the same "
               "slots as an earlier one).")
    if len(report.leaks) > MAX_ROWS:
        st.caption(f"The first {MAX_ROWS:,} of {len(report.leaks):,}, by the event that exposes them "
                   "(`kvscope report leaks --json` has all).")
    leaks = pd.DataFrame([{"#": i, "kind": leak.kind, "pool": leak.pool, "num_slots": len(leak.slots),
                           "slots": ", ".join(map(str, leak.slots[:16])) + (" …" if len(leak.slots) > 16 else ""),
                           "request": leak.rid, "principal": leak.principal, "allocated_step": leak.allocated_step,
                           "free_due_step": leak.free_due_step, "consequence_of": leak.consequence_of,
                           "detail": leak.detail} for i, leak in enumerate(report.leaks[:MAX_ROWS], 1)])
    st.dataframe(leaks, hide_index=True)
if report.suspects:
    st.caption("Suspect requests (ended between the last clean and the first failing check): "
               + ", ".join(report.suspects[:50]))
if report.injected:
    with st.expander(f"Injected faults: the ground truth ({len(report.injected)})"):
        st.dataframe(pd.DataFrame(report.injected).assign(slots=lambda f: f["slots"].map(len)), hide_index=True)
with st.expander("The report as text (`kvscope report leaks`)"):
    st.code(render_text(report, max_leaks=MAX_TEXT_LEAKS), language=None)
