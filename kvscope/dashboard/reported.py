"""The page sections that read an engine's own figures rather than kvscope's records: its
/metrics scrapes (usage rows with NULL where the engine exports nothing) and the page forest its
KV events rebuild (capability "forest"). A page calls one of these where the run lacks the
capability its own section needs (ownership, slots or blocks); the attach loop's counters are
the one section only `kvscope attach` writes. What a source cannot show is one caption
(capability.cannot), never an empty or invented chart.

NOTE: the numbers are the capture's own: the engine's /metrics scrapes (usage rows, NULL where the
engine exports nothing), the page forest's snapshots (cached pages per tier) and its events
(insert, write, revive, evict with reason capacity / to-host / reset, host_evict).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import attached, capability, charts, data, reads, x_axis
from kvscope.dashboard.charts import attached as attached_charts
from kvscope.dashboard.frame import Selection
from kvscope.telemetry import CaptureError
from kvscope.telemetry.capabilities import Capabilities

NOT_PROVIDED_VALUE = "not provided"
SNAPSHOT_KEY = "attached.tree.step"
EVICT_REASONS = {
    "capacity": "left the device and is on no other tier (the engine evicted it)",
    "to-host": "left the device but stays on the host tier (HiCache: a load-back can bring it back)",
    "reset": "the engine cleared its whole cache (every page of every tier went at once)",
}


def _tokens(number: int | None) -> str:
    return NOT_PROVIDED_VALUE if number is None else f"{number:,}"


def _pct(rate: float | None) -> str:
    return NOT_PROVIDED_VALUE if rate is None else f"{rate:.1%}"


def latest_nodes(chosen: Selection) -> tuple[int | None, pd.DataFrame]:
    try:
        return data.latest_snapshot(chosen.path, chosen.run_id, chosen.stamp)
    except CaptureError as err:
        st.error(str(err))
        return None, pd.DataFrame()


# -- Overview ------------------------------------------------------------------------------


def counters_panel(chosen: Selection) -> None:
    counters = data.attach_counters(chosen.path, chosen.run_id, chosen.stamp)
    if counters is None:
        st.caption(
            "The attach loop's counters (batches delivered and lost, gaps, restarts, ...) are stored when "
            "`kvscope attach` ends."
        )
        return
    lost = counters.get("lost_batches", 0)
    if lost:
        st.warning(
            f"{lost:,} event batches were lost on the way (sequence gaps the replay could not fill): the "
            "rebuilt forest may be incomplete (pages missing, or kept after the engine evicted them)."
        )
    names = [name for name in attached.COUNTERS if name in counters]
    for start in range(0, len(names), 4):
        cols = st.columns(4)
        for col, name in zip(cols, names[start : start + 4], strict=False):
            col.metric(name.replace("_", " "), f"{counters[name]:,}", help=attached.COUNTER_HELP[name])


USED_MEANS = {  # NOTE: "used" is SGLang's word; what each engine's figure counts
    "sglang": "SGLang's kv_used_tokens: total - available - evictable",
    "vllm": "vLLM's kv_cache_usage_perc x the capacity: blocks not free (vLLM counts cached blocks no request "
    "holds as free, so this is close to SGLang's total - available - evictable)",
}


def pool_panel(chosen: Selection, caps: Capabilities, last: pd.Series) -> None:
    """The pool as the engine reports it (its /metrics): capacity, used, cached and the hit rate."""
    source = attached.source_of(chosen.run)
    capacity = source.capacity_tokens if source is not None else None
    total = attached.value(last, "full_total") or capacity  # NOTE: 0 is written when unknown
    used = attached.used_tokens(last)
    step, nodes = latest_nodes(chosen)
    cols = st.columns(4)
    cols[0].metric("capacity (tokens)", _tokens(total), help="the engine's KV pool on the device, in tokens")
    share = f"{used / total:.0%} of the capacity" if used is not None and total else "the engine exports no usage"
    cols[1].metric(
        "used (tokens)",
        _tokens(used),
        help=f"as the engine reports it at the latest scrape: {share}; "
        f"{USED_MEANS.get(caps.engine, USED_MEANS['sglang'])}",
    )
    if step is None or caps.lacks("forest"):
        cols[2].metric(
            "cached tokens",
            NOT_PROVIDED_VALUE,
            help="no snapshot of the page forest: the engine's KV events were not subscribed",
        )
    else:
        cached = attached.cached_tokens(nodes)
        cols[2].metric(
            "cached tokens",
            f"{cached['device']:,}",
            help=f"pages on the device in the page forest's latest snapshot (step {step}); "
            f"{cached['host']:,} tokens on the host tier",
        )
    rate = attached.hit_rate(last)
    cols[3].metric(
        "hit rate: tokens",
        NOT_PROVIDED_VALUE if rate is None else _pct(rate.rate),
        help="the engine exports no prefix-cache counters"
        if rate is None
        else f"cached / prompt tokens of the engine's counters since it started (a ratio of sums): "
        f"{rate.hit_tokens:,} of {rate.prompt_tokens:,}",
    )
    if caps.has("usage.split"):
        cols = st.columns(4)
        cols[0].metric("available (tokens)", _tokens(attached.value(last, "full_available")), help="free slots")
        cols[1].metric(
            "evictable (tokens)",
            _tokens(attached.value(last, "full_evictable")),
            help="cached and unlocked: the engine can reclaim them",
        )
    capability.cannot(caps, "usage.split", "locks")


def traffic_panel(chosen: Selection, caps: Capabilities, last: pd.Series) -> None:
    cols = st.columns(4)
    running, waiting = attached.value(last, "num_running"), attached.value(last, "num_waiting")
    cols[0].metric(
        "running / waiting", NOT_PROVIDED_VALUE if running is None or waiting is None else f"{running} / {waiting}"
    )
    label, origin = attached.evicted_label(caps.engine, caps.has("forest"))
    cols[1].metric(label, _tokens(attached.value(last, "cum_evicted_tokens")), help=origin)
    cols[2].metric("preemptions", _tokens(attached.value(last, "cum_retractions")))
    bounds = data.step_range(chosen.path, chosen.run_id, chosen.stamp).iloc[0]
    first = data.usage_at(chosen.path, chosen.run_id, chosen.stamp, int(bounds["lo"]))
    rate = None if first.empty else attached.hit_rate(last, first.iloc[0])
    cols[3].metric(
        "hit rate while attached",
        NOT_PROVIDED_VALUE if rate is None else _pct(rate.rate),
        help="the counters went backwards (an engine restart) or are not exported"
        if rate is None
        else f"the change of the counters since the first scrape: {rate.hit_tokens:,} of "
        f"{rate.prompt_tokens:,} prompt tokens",
    )


def used_timeline(chosen: Selection, caps: Capabilities, usage: pd.DataFrame) -> None:
    """Memory's chart where the source gives its used tokens (not who holds them)."""
    used = attached.used_series(usage)
    st.subheader("Device tokens over time")
    if used.notna().any():
        clock = reads.run_clock(chosen.path, chosen.run_id, chosen.stamp, chosen.run)
        shown, x = x_axis.pick(usage, clock, "attached.memory.x_axis")
        st.caption(
            "One step per scrape of the engine's /metrics: **used** as the engine reports it"
            + (", **available** (free) and **evictable** (cached, unlocked)" if caps.has("usage.split") else "")
            + f", against the capacity (dotted). Downsampled to at most {data.MAX_POINTS} points (each bucket "
            "of scrapes keeps its peak row)."
        )
        st.plotly_chart(attached_charts.device_tokens_figure(shown, used, x), key="attached.memory.tokens")
    else:
        st.caption("Used tokens: not provided by this source's /metrics.")


def tiers(chosen: Selection, caps: Capabilities) -> None:
    """The host tier as the engine reports it and as its page forest holds it."""
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    step, nodes = latest_nodes(chosen)
    last = usage.iloc[-1] if not usage.empty else pd.Series(dtype=object)
    host_total = attached.value(last, "host_total")
    host_available = attached.value(last, "host_available")
    host_used = None if host_total is None or host_available is None else host_total - host_available
    hits, host_hits = attached.value(last, "cum_hit_tokens"), attached.value(last, "cum_host_hit_tokens")
    cols = st.columns(3)
    cols[0].metric(
        "host tokens allocated",
        NOT_PROVIDED_VALUE if host_used is None or host_total is None else f"{host_used:,} of {host_total:,}",
        help="the engine's host pool at the latest scrape",
    )
    cached = attached.cached_tokens(nodes) if step is not None and caps.has("forest") else None
    cols[1].metric(
        "host-tier pages' tokens",
        NOT_PROVIDED_VALUE if cached is None else f"{cached['host']:,}",
        help="pages the page forest holds on the host tier (host only, or backed up from the device) "
        f"in its latest snapshot (step {step})",
    )
    share = host_hits / hits if hits and host_hits is not None else None
    cols[2].metric(
        "host-tier share of hits",
        _pct(share),
        help="the engine exports no host-hit counter"
        if share is None
        else f"{host_hits:,} of {hits:,} cached prompt tokens came from the host",
    )
    if not usage.empty and usage["host_total"].notna().any():
        st.subheader("Tokens per tier")
        st.plotly_chart(
            attached_charts.host_tokens_figure(usage, attached.used_series(usage)), key="attached.tiers.tokens"
        )
    copies_panel(chosen)


def copies_panel(chosen: Selection) -> None:
    counts = data.event_counts(chosen.path, chosen.run_id, chosen.stamp).set_index("kind")["count"]
    evictions = data.eviction_summary(chosen.path, chosen.run_id, chosen.stamp)
    to_host = int(evictions.loc[evictions["reason"] == "to-host", "num_evictions"].sum()) if not evictions.empty else 0
    st.subheader("Pages moving between tiers")
    cols = st.columns(4)
    cols[0].metric(
        "backed up to the host",
        f"{int(counts.get('write', 0)):,}",
        help="pages stored on the host while on the device (write events)",
    )
    cols[1].metric(
        "loaded back",
        f"{int(counts.get('revive', 0)):,}",
        help="pages stored on the device again while on the host (revive events)",
    )
    cols[2].metric("device evictions kept on host", f"{to_host:,}", help="evict events with reason to-host")
    cols[3].metric(
        "host evictions",
        f"{int(counts.get('host_evict', 0)):,}",
        help="pages that left the host tier (host_evict events)",
    )
    st.caption(
        "Counted in pages, from the engine's KV events (a page is one block of the engine). The bytes "
        "copied are not provided: the source does not report the KV bytes of a token."
    )


def forest(chosen: Selection, caps: Capabilities) -> None:
    """The Radix tree page where the tree is the page forest of the engine's KV events: only its
    snapshot steps, one node per page, coloured by tier."""
    steps = data.snapshot_steps(chosen.path, chosen.run_id, chosen.stamp) if caps.has("forest") else []
    if not steps:
        st.info(
            "No snapshot of the page forest in this run yet (the engine's KV events were not subscribed, or "
            "no snapshot was taken)."
        )
        capability.cannot(caps, "locks", "ownership")
        return
    step = (
        steps[-1]
        if len(steps) == 1
        else int(st.select_slider("snapshot step", steps, value=steps[-1], key=SNAPSHOT_KEY))
    )
    nodes = data.tree_at(chosen.path, chosen.run_id, step, chosen.stamp)
    pages = nodes[nodes["parent_id"].notna()]  # NOTE: the root row (no parent) is no page
    cached = attached.cached_tokens(nodes)
    st.caption(
        f"Snapshot at step {step}: {len(pages):,} pages, {cached['device']:,} tokens on the device and "
        f"{cached['host']:,} on the host. One node per page (a block of the engine), coloured by tier: "
        "device, device+host (backed up to the host) or host only (a disk or external store counts as the host "
        "side; the table names every tier). Only snapshot steps are shown: they are the page forest exactly "
        "as `kvscope attach` held it."
    )
    capability.cannot(caps, "locks")
    if pages.empty:
        st.info("The page forest is empty at this step.")
        capability.cannot(caps, "ownership")
        return
    coloured = nodes.assign(tier=[attached.tier_category(t) for t in nodes["tier"]])
    shown = charts.cap_nodes(charts.subtree_values(coloured), charts.tree.DEFAULT_MAX_NODES)
    preview = st.toggle(
        "token previews",
        value=False,
        key="attached.tree.preview",
        help="Prompts can be private: previews stay hidden until you turn them on.",
    )
    st.plotly_chart(charts.tree_figure(shown, "tier", preview), key="attached.tree.icicle")
    columns = ["node_id", "parent_id", "num_tokens", "depth_tokens", "tier", *(["token_preview"] if preview else [])]
    st.dataframe(pages.reindex(columns=columns), hide_index=True)
    capability.cannot(caps, "ownership")


def request_counts(chosen: Selection) -> None:
    """Running and waiting requests and the token hit rate, as the engine reports them per scrape."""
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


def capacity_source(chosen: Selection) -> int | None:
    """The attached engine's own pool, above the planner (which plans for any model and GPU); its
    page size, when the source names one."""
    source = attached.source_of(chosen.run)
    if source is None:
        return None
    if source.capacity_tokens and source.block_size:
        st.caption(
            f"The attached engine's pool: {source.capacity_tokens:,} tokens in "
            f"{source.capacity_tokens // source.block_size:,} pages of {source.block_size}. The planner below "
            "is for the model and GPU you pick, not read from the engine."
        )
    return source.block_size
