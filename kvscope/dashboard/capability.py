"""A run's capabilities as the pages use them (kvscope.telemetry.capabilities, plus what the
data shows), the one line a page shows for a section its source cannot give, and the header
naming a source that is not kvscope's own engine.

NOTE: pages never ask which kind of source a run is; they ask `caps.has(...)` per section.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from kvscope.dashboard import attached, data
from kvscope.dashboard.frame import Selection
from kvscope.telemetry.capabilities import Capabilities, capabilities_of_json


def of(chosen: Selection) -> Capabilities:
    """The run's capabilities: its config's, then what its data shows (tree snapshots; request
    times, a host tier and cached-free blocks per step, which a newer probe or an attached
    engine may record)."""
    caps = capabilities_of_json(getattr(chosen.run, "config", None))
    present = {"tree_snapshots": bool(data.snapshot_steps(chosen.path, chosen.run_id, chosen.stamp))}
    if caps.kind == "engine":  # NOTE: arrive and admit events are written at level full only
        present["in_flight"] = str(getattr(chosen.run, "level", "")) == "full"
    else:
        present["latencies"] = _has_arrivals(chosen)
        if caps.has("tiers") or _has_host_tier(chosen):
            present["tiers"] = True
    if caps.has("blocks") and caps.lacks("usage.split") and _has_evictable(chosen):
        present["usage.split"] = True  # NOTE: a probe that records cached-free blocks per step splits its pool
    return caps.with_data(present)


def _has_evictable(chosen: Selection) -> bool:
    usage = data.usage(chosen.path, chosen.run_id, chosen.stamp)
    return "full_evictable" in usage and bool(pd.to_numeric(usage["full_evictable"], errors="coerce").gt(0).any())


def _has_arrivals(chosen: Selection) -> bool:
    times = data.request_times(chosen.path, chosen.run_id, chosen.stamp, None)
    return "arrive_t" in times and bool(pd.to_numeric(times["arrive_t"], errors="coerce").notna().any())


def _has_host_tier(chosen: Selection) -> bool:
    usage = data.latest_usage(chosen.path, chosen.run_id, chosen.stamp)
    return "host_total" in usage and bool(pd.to_numeric(usage["host_total"], errors="coerce").fillna(0).gt(0).any())


def cannot(caps: Capabilities, *names: str) -> None:
    """One caption per capability this source lacks (nothing for one it has)."""
    for name in names:
        if caps.lacks(name):
            st.caption(caps.cannot_show(name))


def source_header(chosen: Selection, caps: Capabilities) -> None:
    """Who recorded the run, when it is not kvscope's own engine: the attached engine (its URL,
    model, page size and known-bad stream warnings) or the probe inside an engine."""
    if caps.kind == "attach":
        source = attached.source_of(chosen.run)
        if source is not None:
            attached_header(source)
        return
    if caps.kind == "engine":
        return
    size = f" · blocks of {caps.block_size} tokens" if caps.block_size else ""
    st.markdown(f"**Recorded inside {caps.title} by kvscope's probe**{size}")
    st.caption(
        f"From inside the engine's process: its {caps.unit}, the requests that take and release them, and "
        f"its idle census. This source provides: {', '.join(sorted(caps.provides))}."
    )


def attached_header(source: attached.Source) -> None:
    details = [
        f"model {source.model}" if source.model else None,
        f"pages of {source.block_size} tokens" if source.block_size else None,
    ]
    st.markdown(f"**Attached to {source.title}**" + "".join(f" · {d}" for d in details if d))
    given = ", ".join(sorted(source.provides)) or "nothing beyond its capacity"
    st.caption(f"Recorded by `kvscope attach` from the engine's KV events and /metrics. This source provides: {given}.")
    if source.warnings:
        st.warning(
            "**Known-bad event stream for this engine version**\n\n"
            + "\n\n".join(f"- {line}" for line in source.warnings)
        )
