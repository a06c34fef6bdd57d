"""Telemetry: event kinds, the recorder interface, the SQLite capture store and its queries.

The producer side (events, recorders) is imported by mem/cache/engine; the reader side
(queries) by the dashboard and CLI. Nothing here imports torch.
"""

from kvscope.telemetry.events import (
    NULL_RECORDER,
    Event,
    EventKind,
    EvictReason,
    FaultKind,
    ListRecorder,
    NullRecorder,
    PoolName,
    Recorder,
)
from kvscope.telemetry.records import LEVELS, LeakCheck, PoolTerms, RequestRecord, UsageSample

__all__ = [
    "LEVELS",
    "NULL_RECORDER",
    "Event",
    "EventKind",
    "EvictReason",
    "FaultKind",
    "LeakCheck",
    "ListRecorder",
    "NullRecorder",
    "PoolName",
    "PoolTerms",
    "Recorder",
    "RequestRecord",
    "UsageSample",
]
