"""Evictions: the log with reason, node age, idle time and 'evicted, then needed again' (regret).
The summary and the evictions per step render for any source with evict events; the log needs
prefix matches that name their node (capability "regret")."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import attached, capability, charts, data, live, reads, reported, retained, timing
from kvscope.dashboard.frame import Selection, selection
from kvscope.telemetry.capabilities import Capabilities, capabilities_of_json

PAGE_ROWS = 200
# NOTE: about 800 px in all, so the log fits beside the sidebar (it was cut off at the right edge);
# the event's seq and monotonic t_mono are not shown: `time` is the wall clock
LOG_COLUMNS = {
    "step": st.column_config.NumberColumn("step", width=50),
    "time": st.column_config.TextColumn("time", width=95),
    "pool": st.column_config.TextColumn("pool", width=40),
    "node_id": st.column_config.NumberColumn("node", width=50),
    "parent_id": st.column_config.NumberColumn("parent", width=50),
    "evicted_tokens": st.column_config.NumberColumn("tokens", width=55, help="tokens evicted"),
    "reason": st.column_config.TextColumn("reason", width=70),
    "age_steps": st.column_config.NumberColumn("age", width=45, help="node age at eviction, in steps"),
    "age_s": st.column_config.NumberColumn("age (s)", width=55, format="%.3f"),
    "idle_steps": st.column_config.NumberColumn("idle", width=45, help="idle before eviction, in steps"),
    "idle_s": st.column_config.NumberColumn("idle (s)", width=55, format="%.3f"),
    "needed_again_step": st.column_config.NumberColumn("needed again", width=60, help="the step of the later match"),
    "needed_again_by": st.column_config.TextColumn("by", width=75, help="the request whose match needed it again"),
    "regret_tokens": st.column_config.NumberColumn("regret", width=50, help="regret tokens"),
}


def log_table(chosen: Selection, log: pd.DataFrame) -> pd.DataFrame:
    """The log with `time`: the eviction's wall-clock time of day to the millisecond (seconds since
    the run's first event when the capture has no clock), in place of its monotonic t_mono."""
    clock = reads.run_clock(chosen.path, chosen.run_id, chosen.stamp, chosen.run)
    t_mono = pd.to_numeric(log["t_mono"], errors="coerce").astype(float)
    if clock is not None:
        return log.assign(time=clock.times_of_day(t_mono))
    first = reads.first_t_mono(chosen.path, chosen.run_id, chosen.stamp) or 0.0
    return log.assign(time=(t_mono - first).map(lambda s: f"+{s:.3f} s"))


def no_evictions(chosen: Selection, caps: Capabilities) -> None:
    if caps.has("forest") or caps.lacks("ownership"):  # NOTE: the engine's KV events; its own counter beside
        usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
        counter = attached.value(usage.iloc[-1], "cum_evicted_tokens") if not usage.empty else None
        extra = "" if counter is None else f" The engine's own counter says {counter:,} tokens evicted."
        st.info(
            "No evict events in this run (the engine evicted no page while kvscope was attached, or its KV "
            f"events were not subscribed).{extra}"
        )
        return
    if chosen.run.level != "full":
        st.info("No evict events: the run was recorded at level summary, which stores no events.")
        return
    st.info("No evictions in this run.")


def panel(chosen: Selection) -> None:
    """The summary, the evictions per step, and the log (refreshed while the run is running)."""
    caps = capabilities_of_json(getattr(chosen.run, "config", None))
    if caps.lacks("evictions"):  # NOTE: e.g. the SGLang probe at level summary: nothing counted them
        st.info(caps.cannot_show("evictions"))
        return
    summary = data.eviction_summary(chosen.path, chosen.run_id, chosen.stamp)
    if summary.empty:
        no_evictions(chosen, caps)
        return

    if chosen.tenant is not None:
        st.caption(
            f"Evictions are of the whole cache, every tenant's nodes (the tenant filter, {chosen.tenant}, "
            "applies to the Requests page, the Radix tree's node details and the Memory page's sharing views)."
        )
    total = int(summary["num_evictions"].sum())
    cols = st.columns(3)
    cols[0].metric("evictions" if caps.has("slots") else f"evictions ({caps.unit})", f"{total:,}")
    cols[1].metric("evicted tokens", f"{int(summary['evicted_tokens'].sum()):,}")
    cols[2].metric("reasons", ", ".join(sorted(set(summary["reason"]))))
    if caps.has("forest"):
        st.caption(
            "From the engine's KV events, a page at a time: "
            + "; ".join(
                f"**{reason}**: {reported.EVICT_REASONS[reason]}"
                for reason in sorted(set(summary["reason"]))
                if reason in reported.EVICT_REASONS
            )
            + "."
        )
    st.dataframe(summary, hide_index=True)
    over_steps = data.evictions_over_steps(chosen.path, chosen.run_id, chosen.stamp)
    if int(over_steps["steps"].max()) > 1:
        st.caption(
            f"Summed in SQL over buckets of {int(over_steps['steps'].max())} steps (at most {data.MAX_POINTS} points)."
        )
    st.plotly_chart(charts.evictions_figure(over_steps), key="evictions.per_step")
    if caps.has("regret"):
        log_section(chosen, total)
    else:
        capability.cannot(caps, "regret")


def log_section(chosen: Selection, total: int) -> None:
    st.subheader("Eviction log")
    num_pages = max(1, -(-total // PAGE_ROWS))
    page = int(
        st.number_input(f"page (of {num_pages}, {PAGE_ROWS} evictions each)", 1, num_pages, 1, key="evictions.page")
    )
    log = data.eviction_log(chosen.path, chosen.run_id, chosen.stamp, PAGE_ROWS, (page - 1) * PAGE_ROWS)
    regret = log[log["regret_tokens"] > 0]
    cols = st.columns(3)
    cols[0].metric("evicted, then needed again (this page)", f"{len(regret):,} of {len(log):,}")
    cols[1].metric("regret tokens (this page)", f"{int(regret['regret_tokens'].sum()):,}")
    cols[2].metric("median idle before eviction", f"{log['idle_steps'].median():.0f} steps")
    with st.expander("How age, idle and regret are computed", expanded=False):
        st.markdown(
            "- **age**: eviction step/time minus the node's birth (its insert, or the split that made it).\n"
            "- **idle**: eviction time minus the node's last touch — the latest match or lock that ended at this very "
            "node (or its birth). A match that ended deeper also touches it, so idle is an upper bound.\n"
            "- **evicted, then needed again**: a later prefix match stopped at the evicted node (if partly evicted) "
            "or at its parent at eviction time, and then missed tokens. **regret tokens** = min(evicted tokens, that "
            "first match's miss): tokens a later request probably had to recompute. A request that branched off at "
            "the same parent for other reasons counts too, so this is an upper bound."
        )
    st.plotly_chart(charts.eviction_idle_figure(log), key="evictions.idle")
    zone = timing.zone_name() if reads.run_clock(chosen.path, chosen.run_id, chosen.stamp, chosen.run) else None
    st.caption(
        "Times are wall-clock "
        + (f"times of day ({zone})" if zone else "seconds since the run's first event")
        + ", to the millisecond."
    )
    st.dataframe(log_table(chosen, log), hide_index=True, column_config=LOG_COLUMNS, column_order=list(LOG_COLUMNS))


chosen = selection()
st.header("Evictions")
retained.dropped_line(chosen)
capability.source_header(chosen, capability.of(chosen))
live.follow(panel, "evictions")
