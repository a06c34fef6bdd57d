"""Leaks: the memory debugger's report — the invariant terms with the onset, culprits and their slots,
each culprit linked to its request and node; the locks that were never released and what they hold.
A block source (the probe) has its idle census instead: each term per check and the request that
last took each leaked block. A source with no leak checks says so in one line."""

from __future__ import annotations

from datetime import datetime

import pandas as pd
import streamlit as st

from kvscope.dashboard import capability, charts, data, leak_views, reads, retained, url_state
from kvscope.dashboard.frame import PAGES_DIR, Selection, selection
from kvscope.dashboard.verdict import attached_verdict, leak_verdict, show_verdict
from kvscope.debug import Leak, LeakKind, LeakReport, render_text, verdict
from kvscope.telemetry import link_name
from kvscope.telemetry.capabilities import Capabilities

MAX_ROWS = 1000  # culprits shipped to the browser
MAX_TEXT_LEAKS = 100
MAX_NODE_LINKS = 8
WRAPPED_ROW_PX = 70  # NOTE: st.dataframe wraps text only in rows taller than 4rem (64 px)
CULPRIT_COLUMNS = {  # NOTE: about 800 px in all, so the table fits beside the sidebar; wider screens stretch it
    "#": st.column_config.NumberColumn("#", width=40),
    "kind": st.column_config.TextColumn("kind", width=140),
    "slots": st.column_config.TextColumn("slots", width=150, help="how many, then the slot ranges"),
    "request": st.column_config.TextColumn("request", width=105),
    "user": st.column_config.TextColumn("user", width=45),
    "node": st.column_config.TextColumn("node", width=50, help="the locked node"),
    "note": st.column_config.TextColumn("note", width=250),
}

LOCK_COLUMNS = {
    "node": st.column_config.NumberColumn("node", width=50),
    "request": st.column_config.TextColumn("request", width=105),
    "locked at step": st.column_config.NumberColumn("locked at step", width=70),
    "slots in the report": st.column_config.NumberColumn("slots in the report", width=80),
    "slots when locked": st.column_config.NumberColumn("slots when locked", width=80),
    "split off since": st.column_config.TextColumn("split off since", width=230),
    "slots on the path to the root": st.column_config.NumberColumn("slots on the path to the root", width=100),
}


def report_caption(report: LeakReport) -> None:
    if report.stored_at is not None:
        when = datetime.fromtimestamp(report.stored_at).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
        st.caption(
            f"The report stored with the capture when the run closed ({when}; {report.through_seq + 1:,} "
            "events replayed)."
        )
    elif report.level == "full":
        st.caption(
            f"Replayed from the capture's {report.through_seq + 1:,} events just now (the run stored no "
            "report, or it no longer matches)."
        )


def terms_section(chosen: Selection, report: LeakReport) -> None:
    checks = data.leak_checks(chosen.path, chosen.run_id, chosen.stamp)
    steps = sorted(set(checks["step"].astype(int))) if not checks.empty else []
    if len(steps) == 1:
        st.subheader(f"Invariant terms at the idle check (step {steps[0]})")
        st.caption(
            "available + evictable + protected + held + uncached must equal each pool's total; **missing** is "
            "the rest (slots that are neither free, cached nor held: leaked)."
        )
        st.plotly_chart(leak_views.check_terms_figure(checks), key="leaks.terms")
        return
    st.subheader("Invariant terms over time")
    st.caption(
        "At each idle check, available + evictable + protected + held + uncached must equal the pool's total. "
        "The dotted line is, per step, the slots outside the free list and the tree (running requests' tokens, "
        "plus any leak): at idle it must come back to zero."
    )
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    st.plotly_chart(
        charts.leak_terms_figure(checks, usage, report.onset_step, report.first_failure_step), key="leaks.terms"
    )


def census_section(chosen: Selection) -> None:
    """The idle census of a block source: each term at each check, and the pool's counts."""
    checks = data.leak_checks(chosen.path, chosen.run_id, chosen.stamp)
    st.subheader("The block census at each idle point")
    st.caption(
        "At each busy → idle edge every block's ref count is compared with the references the scheduler "
        "can account for, and the free queue with the ref counts: **leaked** (a reference nobody will drop), "
        "**lostref** (released too often), **unqueued** (ref 0, not in the free queue), **qheld** (queued "
        "while referenced), **qcount** (the queue's counter against its list), **orphans** (a block table of "
        "a request that no longer exists). Counts are in blocks."
    )
    if checks.empty:
        st.info("No census yet: the engine has not gone idle since recording started.")
        return
    st.dataframe(leak_views.census_table(checks), hide_index=True)


def census_culprits_section(chosen: Selection, report: LeakReport) -> None:
    """The blocks the failing census terms name, with the request that last took each."""
    st.subheader("Culprits")
    if report.first_failure_step is None:
        st.success("Every census term held: no leaked, over-released or lost block.")
        return
    checks = data.leak_checks(chosen.path, chosen.run_id, chosen.stamp)
    failing = sorted(set(checks.loc[~checks["ok"].astype(bool), "step"].astype(int)))
    step = (
        failing[0]
        if len(failing) == 1
        else int(st.selectbox("failing census (step)", failing, key="leaks.census_step"))
    )
    table = leak_views.census_culprits(checks, step)
    st.caption(
        f"The blocks the census of step {step} names (up to 8 per term; the message counts the rest): "
        "for a leaked block the request that last took it (alloc, or a touch on a prefix hit) and when; for "
        "a block released too often the request it was last released for."
    )
    st.dataframe(table, hide_index=True)
    named = [rid for rid in dict.fromkeys(table["request"].dropna()) if rid in set(reads_rids(chosen))]
    for col, rid in zip(st.columns(max(min(len(named), MAX_NODE_LINKS), 1)), named[:MAX_NODE_LINKS], strict=False):
        col.page_link(
            str(PAGES_DIR / "requests.py"),
            label=f"request {rid} on Requests",
            icon=":material/person:",
            query_params={"capture": link_name(chosen.path), "run": str(chosen.run_id), "rid": rid},
        )


def reads_rids(chosen: Selection) -> list[str]:
    return data.request_ids(chosen.path, chosen.run_id, chosen.stamp, None)


def last_step(chosen: Selection) -> int | None:
    bounds = data.step_range(chosen.path, chosen.run_id, chosen.stamp).iloc[0]
    return None if pd.isna(bounds["hi"]) else int(bounds["hi"])


def culprits_section(chosen: Selection, report: LeakReport) -> None:
    st.subheader("Culprits")
    if not report.leaks:
        st.success("No orphaned slots, double frees, held locks or reads of freed slots.")
        return
    roots = len(report.root_leaks)
    consequences = len(report.leaks) - roots
    st.caption(
        f"{roots:,} root cause{'s' if roots != 1 else ''}, {consequences:,} "
        f"consequence{'s' if consequences != 1 else ''} (a later leak touching the same slots as an "
        "earlier one). Select a row to open its request or node."
    )
    if len(report.leaks) > MAX_ROWS:
        st.caption(
            f"The first {MAX_ROWS:,} of {len(report.leaks):,}, by the event that exposes them "
            "(`kvscope report leaks --json` has all)."
        )
    shown = report.leaks[:MAX_ROWS]
    table = leak_views.culprit_table(shown)
    picked = st.dataframe(
        table,
        hide_index=True,
        column_config=CULPRIT_COLUMNS,
        row_height=WRAPPED_ROW_PX,
        on_select="rerun",
        selection_mode="single-row",
        key="leaks.culprits",
    )
    rows = list(picked.selection.rows) if picked is not None else []
    open_culprit(chosen, shown, int(rows[0]) if rows else 0)


def open_culprit(chosen: Selection, leaks: list[Leak], index: int) -> None:
    """Links to the culprit's request (Requests page) and its node (Radix tree page, at the
    run's last step), through the URL parameters those pages read."""
    leak = leaks[index]
    cols = st.columns([1, 2, 2])
    cols[0].markdown(f"**culprit #{index + 1}**")
    common = {"capture": link_name(chosen.path), "run": str(chosen.run_id)}
    if leak.rid is not None:
        cols[1].page_link(
            str(PAGES_DIR / "requests.py"),
            label=f"request {leak.rid} on Requests",
            icon=":material/person:",
            query_params={**common, "rid": leak.rid},
        )
    hi = last_step(chosen)
    if leak.kind == LeakKind.LOCK_NEVER_RELEASED and leak.node_id is not None and hi is not None:
        cols[2].page_link(
            str(PAGES_DIR / "tree.py"),
            label=f"node {leak.node_id} on Radix tree (step {hi})",
            icon=":material/account_tree:",
            query_params={**common, "step": str(hi), "node": str(leak.node_id)},
        )


def locks_section(chosen: Selection, report: LeakReport) -> None:
    locks = [leak for leak in report.leaks if leak.kind == LeakKind.LOCK_NEVER_RELEASED]
    hi = last_step(chosen)
    if not locks or hi is None:
        return
    st.subheader("Locks never released")
    tree = data.tree_at(chosen.path, chosen.run_id, hi, chosen.stamp)
    paths = leak_views.lock_paths(locks, tree, reads.split_events(chosen.path, chosen.run_id, chosen.stamp))
    st.caption(
        f"A lock holds its node and every node above it up to the root, and a node split after the lock "
        f"hands its upper part to a new parent that the lock still holds. **slots in the report** is what the "
        f"node itself holds at the end (step {hi}); **slots when locked** adds back what splits moved above "
        "it; **slots on the path to the root** stay protected (other locks may share them)."
    )
    st.dataframe(paths, hide_index=True, row_height=WRAPPED_ROW_PX, column_config=LOCK_COLUMNS)
    node_links(chosen, paths, hi)
    for text in injection_differences(report, paths):
        st.info(text, icon=":material/call_split:")


def node_links(chosen: Selection, paths: pd.DataFrame, step: int) -> None:
    """Each locked node on the Radix tree page at the run's last step (its details list who holds it)."""
    shown = paths.head(MAX_NODE_LINKS)
    for col, row in zip(st.columns(max(len(shown), 1)), shown.itertuples(), strict=False):
        col.page_link(
            str(PAGES_DIR / "tree.py"),
            label=f"node {row.node}",
            icon=":material/account_tree:",
            query_params={
                "capture": link_name(chosen.path),
                "run": str(chosen.run_id),
                "step": str(step),
                "node": str(row.node),
            },
        )


def injection_differences(report: LeakReport, paths: pd.DataFrame) -> list[str]:
    """Why an injected lock-leak's slot count differs from the report's, node by node."""
    texts = []
    for fault in report.injected:
        if str(fault.get("kind")) != "lock-leak" or fault.get("node_id") is None:
            continue
        node = int(fault["node_id"])
        row = paths[paths["node"] == node]
        if row.empty or int(row["slots in the report"].iloc[0]) == len(fault["slots"]):
            continue
        found = row.iloc[0]
        texts.append(
            f"Node {node}: the injection record says {len(fault['slots'])} slots — the node as it was when "
            f"request {found['request']} locked it (step {found['locked at step']}). The report says "
            f"{found['slots in the report']} because {found['split off since']} took the rest above it: "
            f"{found['slots when locked']} slots in all, still held by the same lock, along with the rest "
            f"of the path to the root ({found['slots on the path to the root']} slots). Neither number is "
            "wrong: they count the node at two different times."
        )
    return texts


chosen = selection()
st.header("Leaks")
retained.dropped_line(chosen)
caps: Capabilities = capability.of(chosen)
capability.source_header(chosen, caps)
if caps.lacks("leak_checks"):  # NOTE: kvscope cannot balance this source's pool: never "clean"
    shown_verdict = attached_verdict()
    st.info("\n\n".join([f"**{shown_verdict.title}**", *shown_verdict.lines]))
    capability.cannot(caps, "leak_checks", "slots", "locks")
    st.stop()
url_state.show_notes()
if chosen.running:
    st.caption("The run is still running: the report covers what has been flushed so far.")
report = data.leak_report(chosen.path, chosen.run_id, chosen.stamp)
if caps.has("ledger"):  # NOTE: which report: stored at close, or the slot ledger replayed now
    report_caption(report)

shown = leak_verdict(report, data.leak_checks(chosen.path, chosen.run_id, chosen.stamp))
show_verdict(shown._replace(lines=[]))  # NOTE: the failing checks' messages follow below
cols = st.columns(4)
cols[0].metric("verdict", verdict(report).verdict, help="as `kvscope check` says it")
cols[1].metric("idle leak checks", f"{report.checks_run}")
cols[2].metric("first failed check", "–" if report.first_failure_step is None else f"step {report.first_failure_step}")
cols[3].metric(
    "onset",
    "–" if report.onset_step is None else f"step {report.onset_step}",
    help="the first step at which the slot ledger's invariants break (bisected)",
)
if report.note:
    st.info(report.note)
for message in report.first_failure:
    st.error(message)

if caps.has("census"):
    census_section(chosen)
    census_culprits_section(chosen, report)
else:
    terms_section(chosen, report)
if caps.has("ledger"):
    culprits_section(chosen, report)
    locks_section(chosen, report)
else:
    capability.cannot(caps, "ledger")
if report.suspects:
    st.caption(
        "Suspect requests (ended between the last clean and the first failing check): "
        + ", ".join(report.suspects[:50])
    )
if report.injected:
    with st.expander(f"Injected faults: the ground truth ({len(report.injected)})"):
        st.dataframe(pd.DataFrame(report.injected).assign(slots=lambda f: f["slots"].map(len)), hide_index=True)
with st.expander("The report as text (`kvscope report leaks`)"):
    st.code(render_text(report, max_leaks=MAX_TEXT_LEAKS), language=None)
