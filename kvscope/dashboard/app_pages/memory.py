"""Memory: each pool's terms over time (full and SWA side by side), sharing between tenants (tokens
per tenant by visibility, promotions and demotions, cross-principal reuse), token vs page occupancy.
Each section renders what the run's source provides and says in one line what it cannot show."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import capability, charts, data, reads, reported, retained, tenants, x_axis
from kvscope.dashboard.frame import Selection, selection
from kvscope.telemetry.capabilities import Capabilities


def tenant_cache_section(chosen: Selection) -> None:
    step, nodes = data.latest_snapshot(chosen.path, chosen.run_id, chosen.stamp)
    if step is None:
        st.caption("No tree snapshot in this run: tokens per tenant need one (recorded at level summary and up).")
        return
    table = tenants.cache_by_tenant(nodes)
    if chosen.tenant is not None:
        table = table[table["tenant"] == chosen.tenant]
    if table.empty:
        whose = "" if chosen.tenant is None else f" owned by tenant {chosen.tenant}"
        st.caption(f"No cached tokens{whose} in the latest tree snapshot (step {step}).")
        return
    st.caption(
        f"From the latest tree snapshot (step {step}): the tokens each tenant's nodes hold (a node belongs to "
        "the tenant of its owner, the principal that inserted it), **private** (only its owner matches it), "
        "**public** (everyone matches it) or **pinned** (declared public by the operator). A cache with "
        "global sharing (radix, swa-radix) has only public nodes."
    )
    st.plotly_chart(charts.cache_by_tenant_figure(table), key="memory.tenants")


def visibility_changes_section(chosen: Selection, kind: str) -> None:
    changes = data.visibility_changes(chosen.path, chosen.run_id, chosen.stamp)
    if changes.empty:
        why = (
            f"this run used the {kind} cache (global sharing: every node is public from the start)"
            if kind != "scoped-radix"
            else "no prefix was computed by promote_k distinct principals within one epoch, so nothing was promoted"
        )
        if chosen.run.level != "full":
            why = "the run was recorded at level summary (no events)"
        st.caption(f"No promotions or demotions: {why}.")
        return
    totals = changes.groupby("kind")["num_tokens"].sum()
    st.caption(
        f"{int(totals.get('promote', 0)):,} tokens promoted (private → public) and "
        f"{int(totals.get('demote', 0)):,} demoted (public → private) over the run, per step. Promotions and "
        "demotions are of the whole run (a node's owner may be of any tenant)."
    )
    st.plotly_chart(charts.visibility_changes_figure(changes), key="memory.promotions")


def reuse_metric(chosen: Selection) -> None:
    reuse = tenants.reuse_share(data.reuse_by_principal(chosen.path, chosen.run_id, chosen.stamp), chosen.tenant)
    if reuse.share is None:
        st.caption(
            "No cross-principal reuse to show: the capture has no match events naming their requester "
            "(recorded at level full by kvscope with schema version 3), or no match reused a token."
        )
        return
    whose = "" if chosen.tenant is None else f" (requests of tenant {chosen.tenant})"
    st.metric(
        f"cross-principal reuse share{whose}",
        f"{reuse.share:.1%}",
        help=f"{reuse.cross_tokens:,} of {reuse.matched_tokens:,} matched tokens",
    )
    st.caption(
        "Of the tokens prefix matches reused, the share that sat in nodes another principal inserted: how much "
        "the cache's hits depend on sharing across users."
    )


def sharing_section(chosen: Selection) -> None:
    st.subheader("Sharing between tenants")
    kind = data.cache_kind(chosen.run)
    tenant_cache_section(chosen)
    reuse_metric(chosen)
    visibility_changes_section(chosen, kind)


def pools_section(chosen: Selection, usage: pd.DataFrame, caps: Capabilities) -> None:
    st.subheader("Pools over time")
    clock = reads.run_clock(chosen.path, chosen.run_id, chosen.stamp, chosen.run)
    shown, x = x_axis.pick(usage, clock, "memory.x_axis")
    if caps.lacks("locks"):
        st.caption(
            f"Stacked per pool, in tokens ({caps.unit} x their size): **free**"
            + (", **evictable** (cached, unused)" if caps.has("usage.split") else "")
            + f" and **held by requests** (the rest: {caps.unit} running requests hold; with no request "
            "running, anything left here is missing, a leak). Downsampled in SQL to at most "
            f"{data.MAX_POINTS} recorded rows (each bucket of steps keeps its peak row)."
        )
        st.plotly_chart(charts.memory_timeline_figure(shown, x), key="memory.timeline")
        return
    st.caption(
        "Stacked per pool: **free** (the allocator's free list), **evictable** (cached, unlocked), "
        "**protected** (cached, locked by a running request) and **held by requests** (the rest: slots "
        "running requests hold outside the tree; with no request running, anything left here is missing, a "
        f"leak). Downsampled in SQL to at most {data.MAX_POINTS} recorded rows (each bucket of steps keeps its "
        "peak row, so the terms of a point are one step's and stack to its total)."
    )
    st.plotly_chart(charts.memory_timeline_figure(shown, x), key="memory.timeline")


def occupancy_section(chosen: Selection, usage: pd.DataFrame) -> None:
    st.subheader("Token vs page occupancy")
    pool = data.pool_config(chosen.run)
    page_size = int(pool.get("page_size", 1) or 1)
    if page_size == 1:
        st.caption("Page size 1: every slot holds a token, no slot is wasted.")
        return
    waste_section(chosen, usage, page_size)


def waste_section(chosen: Selection, usage: pd.DataFrame, page_size: int) -> None:
    busiest = int(usage.loc[usage["num_running"].astype(int).idxmax(), "step"])
    bounds = data.step_range(chosen.path, chosen.run_id, chosen.stamp).iloc[0]
    step = st.slider(
        "step",
        int(bounds["lo"]),
        int(bounds["hi"]),
        busiest,
        key="memory.step",
        help="defaults to the step with the most running requests",
    )
    waste = data.page_waste(data.running_lengths(chosen.path, chosen.run_id, chosen.stamp, step), page_size)
    at_step = data.usage_at(chosen.path, chosen.run_id, chosen.stamp, step)
    cols = st.columns(4)
    cols[0].metric("page size", f"{page_size} tokens")
    if not at_step.empty:
        slots = data.slots_of_running(at_step.iloc[0])
        cols[1].metric(
            "running requests' slots",
            f"{slots.held:,} of {slots.total:,}",
            help="each slot counted once, from the pool's own terms: the locked prefixes they share in the "
            f"tree ({slots.in_tree:,}, a prefix used by many requests counts once) + their slots "
            f"outside the tree ({slots.own:,}, whole pages; any leaked slots count here too)",
        )
        cols[2].metric(
            "of which in the tree (locked)",
            f"{slots.in_tree:,}",
            help="tree slots locked by running requests: a prefix several requests share is held once",
        )
    cols[3].metric(
        "wasted slots",
        f"{int(waste['wasted_slots'].sum()):,}",
        help="the unused tail of each running request's last page",
    )
    st.caption(
        "Tree nodes are page-aligned, so the waste is in running requests' last pages: a request of "
        f"length L holds ceil(L / {page_size}) pages. L = the hit of its latest prefix match + the tokens "
        "allocated for it since (an estimate from the events). A bar counts the request's shared prefix as its "
        "own, so the bars add up to more than the slots above."
    )
    if waste.empty:
        st.caption(f"No request was running at step {step}.")
    else:
        st.plotly_chart(charts.page_waste_figure(waste), key="memory.waste")


def page(chosen: Selection, caps: Capabilities) -> None:
    capability.source_header(chosen, caps)
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    if usage.empty:
        st.info(
            "No usage samples in this run yet."
            if caps.has("ownership")
            else "No scrape of the engine's /metrics recorded yet."
        )
        return
    if caps.has("ownership"):
        pools_section(chosen, usage, caps)
    else:
        reported.used_timeline(chosen, caps, usage)
    if caps.has("tenants"):
        sharing_section(chosen)
    if caps.has("waste"):
        occupancy_section(chosen, usage)
    capability.cannot(caps, "locks", "slots", "ownership", "swa", "waste", "tenants")


chosen = selection()
st.header("Memory")
retained.dropped_line(chosen)
page(chosen, capability.of(chosen))
