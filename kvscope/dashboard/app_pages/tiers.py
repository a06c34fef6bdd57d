"""Tiers: the device and host tiers of a hiradix run over time, the copies between them (write-back
and load-back, in tokens and bytes), and the share of hits the host tier served. Live.
A run with one tier (every other cache) gets one line saying so, as does a source with no host tier;
an attached engine's tiers come from its /metrics and its page forest."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from kvscope.dashboard import capability, charts, data, live, reported, retained
from kvscope.dashboard.frame import PAGES_DIR, Selection, selection
from kvscope.telemetry import CaptureError

TREE_COLOR_KEY = "tree.color"  # the Radix tree page's colour-by selectbox


def bytes_per_token(run: Any) -> int | None:
    """The device KV bytes of one token (all layers, K and V), from the run's config; None when
    the capture does not record it (in-process captures, captures from before it was recorded)."""
    kv = data.run_config(run).get("kv", {})
    value = kv.get("full_bytes_per_token") if isinstance(kv, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else None


def _bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:,.0f} {unit}" if unit == "B" else f"{num_bytes:,.1f} {unit}"
        num_bytes /= 1024
    return ""  # pragma: no cover - the loop returns at GiB


def _pct(value: float) -> str:
    return "–" if pd.isna(value) else f"{value:.1%}"


def tier_metrics(usage: pd.DataFrame) -> None:
    last = usage.iloc[-1]
    device_total, host_total = int(last["full_total"]), int(last["host_total"])
    device_used, host_used = device_total - int(last["full_available"]), host_total - int(last["host_available"])
    hits, host_hits = int(last["cum_hit_tokens"]), int(last["cum_host_hit_tokens"])
    cols = st.columns(3)
    cols[0].metric(
        "device tokens allocated",
        f"{device_used:,} of {device_total:,}",
        help="the device (full) pool: total - free, at the latest step shown",
    )
    cols[1].metric(
        "host tokens allocated",
        f"{host_used:,} of {host_total:,}",
        help="the host pool: total - free; every allocated host slot is a copy a tree node holds",
    )
    cols[2].metric(
        "host-tier share of hits",
        _pct(host_hits / hits if hits else float("nan")),
        help=f"{host_hits:,} of {hits:,} hit tokens were loaded back from the host at admission",
    )


def copy_metrics(chosen: Selection, usage: pd.DataFrame, per_token: int | None) -> None:
    """Totals of the whole run, and the rate over the recent window (live) or the whole run."""
    whole = charts.copy_totals(usage)
    if chosen.running:
        window = charts.copy_totals(data.latest_usage(chosen.path, chosen.run_id, chosen.stamp), since_start=False)
        when = f"last {window.seconds:.0f} s"
    else:
        window, when = whole, "run average"
    cols = st.columns(4)
    for i, (name, total, recent) in enumerate(
        (
            ("written to host", whole.written_tokens, window.written_tokens),
            ("loaded from host", whole.loaded_tokens, window.loaded_tokens),
        )
    ):
        in_bytes = "" if per_token is None else f" ({_bytes(total * per_token)})"
        cols[2 * i].metric(f"tokens {name}", f"{total:,}", help=f"{total:,} tokens{in_bytes} over the whole run")
        rate = window.per_s(recent)
        cols[2 * i + 1].metric(
            f"{name.split()[0]} rate ({when})",
            "–" if rate is None else f"{rate:,.0f} tok/s",
            help=f"{recent:,} tokens over {window.seconds:.1f} s",
        )
    if per_token is not None:
        st.caption(
            f"In bytes, at {per_token:,} bytes per token: "
            f"{bytes_text(whole.written_tokens, window.per_s(window.written_tokens), per_token, when)} written; "
            f"{bytes_text(whole.loaded_tokens, window.per_s(window.loaded_tokens), per_token, when)} loaded."
        )


def bytes_text(tokens: int, tokens_per_s: float | None, per_token: int, when: str) -> str:
    rate = "" if tokens_per_s is None else f" ({_bytes(tokens_per_s * per_token)}/s, {when})"
    return f"{_bytes(tokens * per_token)}{rate}"


def rates_section(chosen: Selection, usage: pd.DataFrame) -> None:
    st.subheader("Write-back and load-back")
    per_token = bytes_per_token(chosen.run)
    copy_metrics(chosen, usage, per_token)
    unit = "tokens"
    if per_token is None:
        st.caption(
            "In tokens only: this capture does not record the KV bytes of a token (the run config's "
            "`kv.full_bytes_per_token`, written by `kvscope run` and `kvscope serve`)."
        )
    else:
        unit = str(
            st.radio(
                "rates in",
                ["tokens", "bytes"],
                horizontal=True,
                key="tiers.unit",
                help=f"bytes = tokens x {per_token:,} (the device KV bytes of one token)",
            )
        )
    st.caption(
        "Copies started per second between consecutive samples: **write-back** copies device nodes to the "
        "host (on insert with write_through, once hit enough with write_through_selective, on eviction with "
        "write_back); **load-back** copies host-only nodes to the device when a request matches them."
    )
    st.plotly_chart(charts.copy_rates_figure(charts.copy_rates(usage, per_token), unit), key="tiers.rates")
    event_detail(chosen)


def event_detail(chosen: Selection) -> None:
    if chosen.run.level != "full":
        st.caption(
            "Counts of host evictions and drops need the events (level full); this run was recorded at "
            f"level {chosen.run.level}."
        )
        return
    try:
        counts = data.event_counts(chosen.path, chosen.run_id, chosen.stamp).set_index("kind")["count"]
        evictions = data.eviction_summary(chosen.path, chosen.run_id, chosen.stamp)
    except CaptureError as err:  # the events are damaged: the usage charts above and below still stand
        st.error(str(err))
        return
    by_reason = evictions.groupby("reason")[["num_evictions", "evicted_tokens"]].sum()

    def reason(name: str) -> tuple[int, int]:
        return (
            (int(by_reason.at[name, "num_evictions"]), int(by_reason.at[name, "evicted_tokens"]))
            if name in by_reason.index
            else (0, 0)
        )

    (to_host, to_host_tokens), (drops, drop_tokens) = reason("to-host"), reason("drop")
    cols = st.columns(4)
    cols[0].metric(
        "copy operations",
        f"{int(counts.get('write', 0)):,} / {int(counts.get('load', 0)):,}",
        help="write (device → host) / load (host → device) operations started",
    )
    cols[1].metric(
        "device evictions kept on host",
        f"{to_host:,}",
        help=f"{to_host_tokens:,} tokens left the device and stayed in the tree as host-only nodes",
    )
    cols[2].metric(
        "host evictions",
        f"{int(counts.get('host_evict', 0)):,}",
        help="host copies that left the tree: to make room on the host, or under a dropped leaf",
    )
    cols[3].metric(
        "drops",
        f"{drops:,}",
        help=f"{drop_tokens:,} tokens: leaves deleted from the device because "
        "the host could not take them (write_back)",
    )


def tree_section(chosen: Selection) -> None:
    try:
        step, nodes = data.latest_snapshot(chosen.path, chosen.run_id, chosen.stamp)
    except CaptureError as err:  # the snapshot replays events: damaged ones are usually named above already
        st.caption(f"The tree's tokens by tier are not shown: {err}")
        return
    if step is not None and "tier" in nodes:
        tokens = nodes.groupby("tier")["num_tokens"].sum()
        mix = ", ".join(f"{int(tokens.get(tier, 0)):,} {tier}" for tier in charts.TIERS)
        st.caption(
            f"The latest tree snapshot (step {step}) holds tokens by tier: {mix}. The Radix tree page colours "
            "every node by its tier at any step."
        )


def live_panel() -> None:
    tiers_view(live.refreshed(selection()))


def tiers_view(chosen: Selection) -> None:
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    st.caption(f"run {chosen.run_id} · **{chosen.status}**" + (" · refreshing every second" if chosen.live else ""))
    if usage.empty:
        st.info("No usage samples in this run yet.")
        return
    if not charts.has_host_tier(usage):
        st.caption(
            f"This run used the {data.cache_kind(chosen.run)} cache: one tier (the device). A host tier needs "
            "`--cache hiradix` (and a capture of schema version 4 or later)."
        )
        return
    tier_metrics(usage)
    st.subheader("Tokens per tier")
    st.caption(
        'Allocated (total - free; SGLang\'s "used" also leaves out what the tree could evict) against '
        "each tier's total. On the host, every allocated slot is a node's copy; on "
        f"the device, running requests' slots count too. Downsampled to at most {data.MAX_POINTS} "
        "recorded rows (each bucket of steps keeps each tier's peak row)."
    )
    st.plotly_chart(charts.tier_tokens_figure(usage), key="tiers.tokens")
    rates_section(chosen, usage)
    st.subheader("Hits served by the host tier")
    st.caption(
        "Of all prompt tokens hit so far, the share loaded back from the host at admission (the rest were "
        "still on the device)."
    )
    st.plotly_chart(charts.host_hit_share_figure(usage), key="tiers.share")
    tree_section(chosen)


chosen = selection()
st.header("Tiers")
retained.dropped_line(chosen)
caps = capability.of(chosen)
capability.source_header(chosen, caps)
if caps.lacks("tiers"):
    capability.cannot(caps, "tiers")
    st.stop()
if caps.lacks("ownership"):  # NOTE: the engine's own figures (its /metrics) and the page forest of its KV events
    reported.tiers(chosen, caps)
    st.stop()
live.fragment(live_panel, chosen.live)
if caps.has("tree") and st.button(
    "Open the Radix tree coloured by tier", key="tiers.to_tree", icon=":material/account_tree:"
):
    st.session_state[TREE_COLOR_KEY] = "tier"
    st.switch_page(str(PAGES_DIR / "tree.py"))
