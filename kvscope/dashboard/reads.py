"""Cached reads for the links, time and leak views (the shape of data.py: kvscope.telemetry reads,
keyed by (path, run_id, stamp, ...); no SQL here)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import streamlit as st

from kvscope import telemetry
from kvscope.dashboard import data
from kvscope.dashboard.timing import Clock, clock_of
from kvscope.telemetry import EventKind, decode_slots

ALL_ROWS = 10_000_000
EVENT_COLUMNS = ["seq", "step", "kind", "rid", "node_id", "num_tokens", "aux", "reason"]  # NOTE: what is read:
# never slots or t_mono (on a 10M-event capture the slot blobs of every lock event alone cost seconds)


@st.cache_data(ttl=data.CACHE_TTL_S, show_spinner=False)
def first_t_mono(path: str, run_id: int, stamp: float) -> float | None:
    """The run's earliest monotonic time: its first event, else its first request's arrival or
    its first usage sample (a summary capture has no events)."""
    capture = data.open_capture(path)
    found = _earliest([capture.events(run_id, limit=1)["t_mono"], pd.Series([capture.first_arrival(run_id)])])
    return found if found is not None else _earliest([capture.usage(run_id, max_points=ALL_ROWS)["t_mono"]])


def _earliest(columns: list[pd.Series]) -> float | None:
    values = [float(v) for c in columns for v in pd.to_numeric(c, errors="coerce").dropna()]
    finite = [v for v in values if math.isfinite(v)]
    return min(finite) if finite else None


def run_clock(path: str, run_id: int, stamp: float, run: Any) -> Clock | None:
    """The run's wall clock (timing.clock_of): the config's anchor, else started_at."""
    config = data.run_config(run)
    if isinstance(config.get("clock"), dict):
        return clock_of(config, run.started_at, None)
    return clock_of(config, run.started_at, first_t_mono(path, run_id, stamp))


@st.cache_data(ttl=data.CACHE_TTL_S, show_spinner=False)
def has_lock_events(path: str, run_id: int, stamp: float) -> bool:
    """Whether the run recorded a lock or an unlock of a tree node (none in a summary capture). NOTE: from
    the run's events per kind (its folded summaries, schema 14: one row), not a search of its chunks."""
    counts = data.event_counts(path, run_id, stamp)
    locks = counts[counts["kind"].isin([EventKind.LOCK.value, EventKind.UNLOCK.value])]
    return bool((locks["count"] > 0).any())


@st.cache_data(ttl=data.CACHE_TTL_S, show_spinner=False)
def held_locks(path: str, run_id: int, stamp: float, step: int) -> pd.DataFrame:
    """The locks held after `step` (telemetry.held_locks: node_id, rid, since_step), holders named."""
    return telemetry.held_locks(data.open_capture(path), run_id, step)


@st.cache_data(ttl=data.CACHE_TTL_S, show_spinner=False)
def split_events(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    """Every node split: node_id is the new upper node, aux the node it was cut from,
    num_tokens the tokens that moved up."""
    events = data.open_capture(path).events(run_id, kinds=[EventKind.SPLIT], limit=None, columns=EVENT_COLUMNS)
    return events.reindex(columns=EVENT_COLUMNS)


BLOCK_COLUMNS = ["seq", "step", "kind", "rid", "slots"]


@st.cache_data(ttl=data.CACHE_TTL_S, show_spinner=False)
def block_events(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    """Every take (alloc, touch) and release (free, unlock) of a block source's blocks, in event
    order, with `blocks` (the block ids of each event) in place of its slots blob."""
    kinds = [EventKind.ALLOC, EventKind.LOCK, EventKind.FREE, EventKind.UNLOCK]
    events = data.open_capture(path).events(run_id, kinds=kinds, limit=None, columns=BLOCK_COLUMNS)
    events = events.reindex(columns=BLOCK_COLUMNS)
    return events.assign(blocks=[set(decode_slots(blob)) for blob in events["slots"]]).drop(columns=["slots"])


@st.cache_data(ttl=data.CACHE_TTL_S, show_spinner=False)
def lookup_stops(path: str, run_id: int, stamp: float) -> pd.DataFrame:
    """Prefix lookups by why they stopped (the match events' reason, which a probe records):
    reason, lookups, hit tokens, missed tokens; empty when no match event names a reason."""
    table = telemetry.lookup_stops(data.open_capture(path), run_id)
    table = table.sort_values("lookups", ascending=False).reset_index(drop=True)
    table.columns = ["why the lookup stopped", "lookups", "hit tokens", "missed tokens"]
    return table
