"""Telemetry: event kinds and the recorder interface (the SQLite store comes later)."""

from kvscope.telemetry.events import (
    NULL_RECORDER,
    Event,
    EventKind,
    EvictReason,
    ListRecorder,
    NullRecorder,
    PoolName,
    Recorder,
)

__all__ = [
    "NULL_RECORDER",
    "Event",
    "EventKind",
    "EvictReason",
    "ListRecorder",
    "NullRecorder",
    "PoolName",
    "Recorder",
]
