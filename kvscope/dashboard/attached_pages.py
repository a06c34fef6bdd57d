"""Each page's view of an attached capture (`kvscope attach`): what the source provides, and one
plain caption (attached.NOT_PROVIDED) for each thing it does not, instead of an empty or invented
chart. A page calls its function here right after its header when the run has a source, then
stops; engine runs never come here.

NOTE: the numbers are the capture's own: the engine's /metrics scrapes (usage rows, NULL where the
engine exports nothing), the page forest's snapshots (cached pages per tier) and its events
(insert, write, revive, evict with reason capacity / to-host / reset, host_evict).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from kvscope.dashboard import attached, charts, data
from kvscope.dashboard.attached import NOT_PROVIDED, Source
from kvscope.dashboard.charts import attached as attached_charts
from kvscope.dashboard.frame import Selection, selection
from kvscope.dashboard.verdict import attached_verdict
from kvscope.telemetry import CaptureError

NOT_PROVIDED_VALUE = "not provided"
SNAPSHOT_KEY = "attached.tree.step"
EVICT_REASONS = {
    "capacity": "left the device and is on no other tier (the engine evicted it)",
    "to-host": "left the device but stays on the host tier (HiCache: a load-back can bring it back)",
    "reset": "the engine cleared its whole cache (every page of every tier went at once)",
}


def fresh(chosen: Selection) -> Selection:
    """The selection with this rerun's stamp (a live fragment reruns alone and reads the run again)."""
    runs = data.runs(chosen.path)
    run = runs[runs["id"] == chosen.run_id].iloc[0]
    if chosen.live and run["display_status"] != "running":
        st.rerun()
    return chosen._replace(run=run, status=str(run["display_status"]),
                           stamp=float(run["heartbeat_at"] or 0.0) + float(run["ended_at"] or 0.0))


def _tokens(number: int | None) -> str:
    return NOT_PROVIDED_VALUE if number is None else f"{number:,}"


def _pct(rate: float | None) -> str:
    return NOT_PROVIDED_VALUE if rate is None else f"{rate:.1%}"


def not_provided(*things: str) -> None:
    for thing in things:
        st.caption(NOT_PROVIDED[thing])


def source_header(source: Source) -> None:
    details = [f"model {source.model}" if source.model else None,
               f"pages of {source.block_size} tokens" if source.block_size else None]
    st.markdown(f"**Attached to {source.title}**" + "".join(f" · {d}" for d in details if d))
    given = ", ".join(sorted(source.provides)) or "nothing beyond its capacity"
    st.caption(f"Recorded by `kvscope attach` from the engine's KV events and /metrics. This source provides: "
               f"{given}.")
    if source.warnings:
        st.warning("**Known-bad event stream for this engine version**\n\n"
                   + "\n\n".join(f"- {line}" for line in source.warnings))


def latest_nodes(chosen: Selection) -> tuple[int | None, pd.DataFrame]:
    try:
        return data.latest_snapshot(chosen.path, chosen.run_id, chosen.stamp)
    except CaptureError as err:
        st.error(str(err))
        return None, pd.DataFrame()


# -- Overview ------------------------------------------------------------------------------


def overview_panel() -> None:
    """The Overview of an attached run (a fragment: it refreshes while the attach is running)."""
    chosen = fresh(selection())
    source = attached.source_of(chosen.run)
    assert source is not None
    st.caption(f"run {chosen.run_id} · **{chosen.status}**" + (" · refreshing every second" if chosen.live else ""))
    source_header(source)
    verdict = attached_verdict()
    st.info("\n\n".join([f"**{verdict.title}**", *verdict.lines]))
    counters_panel(chosen)
    rows = data.latest_usage(chosen.path, chosen.run_id, chosen.stamp)
    if rows.empty:
        st.info("No scrape of the engine's /metrics recorded yet.")
        return
    pool_panel(chosen, source, rows.iloc[-1])
    traffic_panel(chosen, source, rows.iloc[-1])


def counters_panel(chosen: Selection) -> None:
    counters = data.attach_counters(chosen.path, chosen.run_id, chosen.stamp)
    if counters is None:
        st.caption("The attach loop's counters (batches delivered and lost, gaps, restarts, ...) are stored when "
                   "`kvscope attach` ends.")
        return
    lost = counters.get("lost_batches", 0)
    if lost:
        st.warning(f"{lost:,} event batches were lost on the way (sequence gaps the replay could not fill): the "
                   "rebuilt forest may be incomplete (pages missing, or kept after the engine evicted them).")
    names = [name for name in attached.COUNTERS if name in counters]
    for start in range(0, len(names), 4):
        cols = st.columns(4)
        for col, name in zip(cols, names[start:start + 4], strict=False):
            col.metric(name.replace("_", " "), f"{counters[name]:,}", help=attached.COUNTER_HELP[name])


USED_MEANS = {  # NOTE: "used" is SGLang's word; what each engine's figure counts
    "sglang": "SGLang's kv_used_tokens: total - available - evictable",
    "vllm": "vLLM's kv_cache_usage_perc x the capacity: blocks not free (vLLM counts cached blocks no request "
            "holds as free, so this is close to SGLang's total - available - evictable)",
}


def pool_panel(chosen: Selection, source: Source, last: pd.Series) -> None:
    total = attached.value(last, "full_total") or source.capacity_tokens  # NOTE: 0 is written when unknown
    used = attached.used_tokens(last)
    step, nodes = latest_nodes(chosen)
    cols = st.columns(4)
    cols[0].metric("capacity (tokens)", _tokens(total), help="the engine's KV pool on the device, in tokens")
    share = f"{used / total:.0%} of the capacity" if used is not None and total else "the engine exports no usage"
    cols[1].metric("used (tokens)", _tokens(used), help=f"as the engine reports it at the latest scrape: {share}; "
                   f"{USED_MEANS.get(source.engine, USED_MEANS['sglang'])}")
    if step is None or not source.gives("pages"):
        cols[2].metric("cached tokens", NOT_PROVIDED_VALUE,
                       help="no snapshot of the page forest: the engine's KV events were not subscribed")
    else:
        cached = attached.cached_tokens(nodes)
        cols[2].metric("cached tokens", f"{cached['device']:,}",
                       help=f"pages on the device in the page forest's latest snapshot (step {step}); "
                            f"{cached['host']:,} tokens on the host tier")
    rate = attached.hit_rate(last)
    cols[3].metric("hit rate: tokens", NOT_PROVIDED_VALUE if rate is None else _pct(rate.rate),
                   help="the engine exports no prefix-cache counters" if rate is None else
                   f"cached / prompt tokens of the engine's counters since it started (a ratio of sums): "
                   f"{rate.hit_tokens:,} of {rate.prompt_tokens:,}")
    if source.gives("usage.split"):
        cols = st.columns(4)
        cols[0].metric("available (tokens)", _tokens(attached.value(last, "full_available")), help="free slots")
        cols[1].metric("evictable (tokens)", _tokens(attached.value(last, "full_evictable")),
                       help="cached and unlocked: the engine can reclaim them")
    else:
        st.caption("Free and evictable tokens: not provided. This source does not split its pool (vLLM, for one, "
                   "counts cached but unused blocks as free), so only the used tokens are shown.")
    not_provided("locks")


def traffic_panel(chosen: Selection, source: Source, last: pd.Series) -> None:
    cols = st.columns(4)
    running, waiting = attached.value(last, "num_running"), attached.value(last, "num_waiting")
    cols[0].metric("running / waiting", NOT_PROVIDED_VALUE if running is None or waiting is None
                   else f"{running} / {waiting}")
    label, origin = attached.evicted_label(source)
    cols[1].metric(label, _tokens(attached.value(last, "cum_evicted_tokens")), help=origin)
    cols[2].metric("preemptions", _tokens(attached.value(last, "cum_retractions")))
    bounds = data.step_range(chosen.path, chosen.run_id, chosen.stamp).iloc[0]
    first = data.usage_at(chosen.path, chosen.run_id, chosen.stamp, int(bounds["lo"]))
    rate = None if first.empty else attached.hit_rate(last, first.iloc[0])
    cols[3].metric("hit rate while attached", NOT_PROVIDED_VALUE if rate is None else _pct(rate.rate),
                   help="the counters went backwards (an engine restart) or are not exported" if rate is None else
                   f"the change of the counters since the first scrape: {rate.hit_tokens:,} of "
                   f"{rate.prompt_tokens:,} prompt tokens")


# -- Memory --------------------------------------------------------------------------------


def memory(chosen: Selection, source: Source) -> None:
    source_header(source)
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    if usage.empty:
        st.info("No scrape of the engine's /metrics recorded yet.")
        return
    used = attached.used_series(usage)
    st.subheader("Device tokens over time")
    if used.notna().any():
        st.caption("One step per scrape of the engine's /metrics: **used** as the engine reports it"
                   + (", **available** (free) and **evictable** (cached, unlocked)" if source.gives("usage.split")
                      else "")
                   + f", against the capacity (dotted). Downsampled to at most {data.MAX_POINTS} points (each bucket "
                   "of scrapes keeps its peak row).")
        st.plotly_chart(attached_charts.device_tokens_figure(usage, used), key="attached.memory.tokens")
    else:
        st.caption("Used tokens: not provided by this source's /metrics.")
    not_provided("locks", "slots", "requests", "swa", "waste")


# -- Tiers ---------------------------------------------------------------------------------


def tiers(chosen: Selection, source: Source) -> None:
    source_header(source)
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    step, nodes = latest_nodes(chosen)
    if not (source.gives("host_tier") or charts.has_host_tier(usage)):
        st.caption(f"This source provides no host tier ({source.engine} reports one tier, the device): only "
                   "device pages are followed.")
        return
    last = usage.iloc[-1] if not usage.empty else pd.Series(dtype=object)
    host_total = attached.value(last, "host_total")
    host_available = attached.value(last, "host_available")
    host_used = None if host_total is None or host_available is None else host_total - host_available
    hits, host_hits = attached.value(last, "cum_hit_tokens"), attached.value(last, "cum_host_hit_tokens")
    cols = st.columns(3)
    cols[0].metric("host tokens allocated", NOT_PROVIDED_VALUE if host_used is None or host_total is None
                   else f"{host_used:,} of {host_total:,}", help="the engine's host pool at the latest scrape")
    cached = attached.cached_tokens(nodes) if step is not None and source.gives("pages") else None
    cols[1].metric("host-tier pages' tokens", NOT_PROVIDED_VALUE if cached is None else f"{cached['host']:,}",
                   help="pages the page forest holds on the host tier (host only, or backed up from the device) "
                        f"in its latest snapshot (step {step})")
    share = host_hits / hits if hits and host_hits is not None else None
    cols[2].metric("host-tier share of hits", _pct(share),
                   help="the engine exports no host-hit counter" if share is None else
                   f"{host_hits:,} of {hits:,} cached prompt tokens came from the host")
    if not usage.empty and usage["host_total"].notna().any():
        st.subheader("Tokens per tier")
        st.plotly_chart(attached_charts.host_tokens_figure(usage, attached.used_series(usage)),
                        key="attached.tiers.tokens")
    copies_panel(chosen)


def copies_panel(chosen: Selection) -> None:
    counts = data.event_counts(chosen.path, chosen.run_id, chosen.stamp).set_index("kind")["count"]
    evictions = data.eviction_summary(chosen.path, chosen.run_id, chosen.stamp)
    to_host = int(evictions.loc[evictions["reason"] == "to-host", "num_evictions"].sum()) if not evictions.empty else 0
    st.subheader("Pages moving between tiers")
    cols = st.columns(4)
    cols[0].metric("backed up to the host", f"{int(counts.get('write', 0)):,}",
                   help="pages stored on the host while on the device (write events)")
    cols[1].metric("loaded back", f"{int(counts.get('revive', 0)):,}",
                   help="pages stored on the device again while on the host (revive events)")
    cols[2].metric("device evictions kept on host", f"{to_host:,}", help="evict events with reason to-host")
    cols[3].metric("host evictions", f"{int(counts.get('host_evict', 0)):,}",
                   help="pages that left the host tier (host_evict events)")
    st.caption("Counted in pages, from the engine's KV events (a page is one block of the engine). The bytes "
               "copied are not provided: the source does not report the KV bytes of a token.")


# -- Radix tree ----------------------------------------------------------------------------


def tree(chosen: Selection, source: Source) -> None:
    source_header(source)
    steps = data.snapshot_steps(chosen.path, chosen.run_id, chosen.stamp) if source.gives("pages") else []
    if not steps:
        st.info("No snapshot of the page forest in this run yet (the engine's KV events were not subscribed, or "
                "no snapshot was taken).")
        not_provided("locks", "requests")
        return
    step = steps[-1] if len(steps) == 1 else int(st.select_slider("snapshot step", steps, value=steps[-1],
                                                                  key=SNAPSHOT_KEY))
    nodes = data.tree_at(chosen.path, chosen.run_id, step, chosen.stamp)
    pages = nodes[nodes["parent_id"].notna()]  # NOTE: the root row (no parent) is no page
    cached = attached.cached_tokens(nodes)
    st.caption(f"Snapshot at step {step}: {len(pages):,} pages, {cached['device']:,} tokens on the device and "
               f"{cached['host']:,} on the host. One node per page (a block of the engine), coloured by tier: "
               "device, device+host (backed up to the host) or host only (a disk or external store counts as the host "
               "side; the table names every tier). Only snapshot steps are shown: they are the page forest exactly "
               "as `kvscope attach` held it.")
    not_provided("locks")
    if pages.empty:
        st.info("The page forest is empty at this step.")
        not_provided("requests")
        return
    coloured = nodes.assign(tier=[attached.tier_category(t) for t in nodes["tier"]])
    shown = charts.cap_nodes(charts.subtree_values(coloured), charts.tree.DEFAULT_MAX_NODES)
    preview = st.toggle("token previews", value=False, key="attached.tree.preview",
                        help="Prompts can be private: previews stay hidden until you turn them on.")
    st.plotly_chart(charts.tree_figure(shown, "tier", preview), key="attached.tree.icicle")
    columns = ["node_id", "parent_id", "num_tokens", "depth_tokens", "tier", *(["token_preview"] if preview else [])]
    st.dataframe(pages.reindex(columns=columns), hide_index=True)
    not_provided("requests")


# -- Evictions -----------------------------------------------------------------------------


def evictions(chosen: Selection, source: Source) -> None:
    source_header(source)
    summary = data.eviction_summary(chosen.path, chosen.run_id, chosen.stamp)
    if summary.empty:
        usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
        counter = attached.value(usage.iloc[-1], "cum_evicted_tokens") if not usage.empty else None
        extra = "" if counter is None else f" The engine's own counter says {counter:,} tokens evicted."
        st.info("No evict events in this run (the engine evicted no page while kvscope was attached, or its KV "
                f"events were not subscribed).{extra}")
        return
    total = int(summary["num_evictions"].sum())
    cols = st.columns(3)
    cols[0].metric("evictions (pages)", f"{total:,}")
    cols[1].metric("evicted tokens", f"{int(summary['evicted_tokens'].sum()):,}")
    cols[2].metric("reasons", ", ".join(sorted(set(summary["reason"]))))
    st.caption("From the engine's KV events, a page at a time: "
               + "; ".join(f"**{reason}**: {EVICT_REASONS[reason]}" for reason in sorted(set(summary["reason"]))
                           if reason in EVICT_REASONS) + ".")
    st.dataframe(summary, hide_index=True)
    over_steps = data.evictions_over_steps(chosen.path, chosen.run_id, chosen.stamp)
    st.plotly_chart(charts.evictions_figure(over_steps), key="attached.evictions.per_step")
    st.caption("Age, idle time and 'evicted, then needed again' are not provided: the engine's events record no "
               "prefix match, so kvscope cannot tell when a page was last used or needed again.")


# -- Leaks, Requests -----------------------------------------------------------------------


def leaks(chosen: Selection, source: Source) -> None:
    source_header(source)
    verdict = attached_verdict()
    st.info("\n\n".join([f"**{verdict.title}**", *verdict.lines]))
    not_provided("leaks", "slots", "locks")


def requests(chosen: Selection, source: Source) -> None:
    source_header(source)
    not_provided("requests")
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    if usage.empty:
        st.info("No scrape of the engine's /metrics recorded yet.")
        return
    if _known(usage, "num_running") and _known(usage, "num_waiting"):
        st.subheader("Running and waiting requests")
        st.caption("As the engine reports them at each scrape.")
        st.plotly_chart(attached_charts.request_counts_figure(usage), key="attached.requests.counts")
    else:
        st.caption("Running and waiting requests: not provided by this source's /metrics.")
    if _known(usage, "cum_prompt_tokens") and _known(usage, "cum_hit_tokens"):
        st.subheader("Token hit rate so far")
        st.caption("Cached / prompt tokens of the engine's counters since it started, at each scrape.")
        st.plotly_chart(attached_charts.hit_rate_figure(usage), key="attached.requests.hit_rate")
    else:
        st.caption("The token hit rate: not provided (the engine exports no prefix-cache counters).")


def _known(usage: pd.DataFrame, column: str) -> bool:
    return column in usage and bool(pd.to_numeric(usage[column], errors="coerce").notna().any())


def capacity_source(source: Source) -> None:
    """The attached engine's own pool, above the planner (which plans for any model and GPU)."""
    if source.capacity_tokens and source.block_size:
        st.caption(f"The attached engine's pool: {source.capacity_tokens:,} tokens in "
                   f"{source.capacity_tokens // source.block_size:,} pages of {source.block_size}. The planner below "
                   "is for the model and GPU you pick, not read from the engine.")


def capacity_note(source: Source) -> None:
    """The Capacity page's curve needs the request stream, which an attached source does not give."""
    st.caption("Hit rate vs cache capacity for this engine's traffic: not provided. The curve replays the run's "
               f"request stream, and {source.engine}'s events carry no requests (`kvscope plan` takes a request "
               "trace instead).")


def page_size(source: Source, fallback: Any) -> int:
    return int(source.block_size or fallback or 1)
