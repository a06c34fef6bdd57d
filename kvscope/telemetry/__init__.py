"""Telemetry: event kinds, the recorder interface, the one schema declaration (schema.py), the
capture store and every read of a capture.

The producer side (events, records) is imported by mem/cache/engine on the hot path; the
reader and writer side (the SQL recorder, the store, queries, derived reads, tree replay) by
the app layer, the debugger and the dashboard. Nothing here imports torch.

NOTE: importing this package loads only the producer side (no numpy, pandas or SQLAlchemy);
the reader and writer names below load their module on first use (module __getattr__).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvscope.telemetry.events import (
    NULL_RECORDER,
    CopyKind,
    Event,
    EventKind,
    EvictReason,
    FaultKind,
    ListRecorder,
    LookupStop,
    NullRecorder,
    PoolName,
    Recorder,
    Visibility,
)
from kvscope.telemetry.principals import tenant_of
from kvscope.telemetry.records import (
    LEVELS,
    CensusBlock,
    LeakCheck,
    NodeRow,
    PoolTerms,
    RequestRecord,
    RequestStatus,
    Routing,
    RunStatus,
    UsageSample,
)

if TYPE_CHECKING:
    from kvscope.telemetry.derived import (
        EVICTION_LOG_COLUMNS,
        allocs_of_requests,
        eviction_log,
        eviction_summary,
        evictions_over_steps,
        held_locks,
        in_flight,
        lookup_stops,
        recent_evictions,
        running_lengths,
    )
    from kvscope.telemetry.fingerprint import environment_fingerprint
    from kvscope.telemetry.queries import ENDED_WITHOUT_CLOSING, Capture, display_status
    from kvscope.telemetry.recorder import SQLRecorder, decode_slots, install_signal_handlers, slots_blob
    from kvscope.telemetry.request_sums import MAX_RELATIVE_ERROR, REQUEST_LATENCIES, Histogram
    from kvscope.telemetry.retention import Retention, parse_duration_s, parse_size_bytes
    from kvscope.telemetry.sharing import reuse_by_principal, run_principals, visibility_changes
    from kvscope.telemetry.store import (
        CaptureError,
        display_name,
        link_name,
        open_reader,
        open_writer,
        save_ledger_checkpoint,
        save_report,
    )
    from kvscope.telemetry.tree_replay import STRUCTURAL_KINDS, replay_tree

_LAZY = {
    "kvscope.telemetry.derived": (
        "EVICTION_LOG_COLUMNS",
        "allocs_of_requests",
        "eviction_log",
        "eviction_summary",
        "evictions_over_steps",
        "held_locks",
        "in_flight",
        "lookup_stops",
        "recent_evictions",
        "running_lengths",
    ),
    "kvscope.telemetry.fingerprint": ("environment_fingerprint",),
    "kvscope.telemetry.queries": ("ENDED_WITHOUT_CLOSING", "Capture", "display_status"),
    "kvscope.telemetry.recorder": ("SQLRecorder", "decode_slots", "install_signal_handlers", "slots_blob"),
    "kvscope.telemetry.request_sums": ("MAX_RELATIVE_ERROR", "REQUEST_LATENCIES", "Histogram"),
    "kvscope.telemetry.retention": ("Retention", "parse_duration_s", "parse_size_bytes"),
    "kvscope.telemetry.sharing": ("reuse_by_principal", "run_principals", "visibility_changes"),
    "kvscope.telemetry.store": (
        "CaptureError",
        "display_name",
        "link_name",
        "open_reader",
        "open_writer",
        "save_ledger_checkpoint",
        "save_report",
    ),
    "kvscope.telemetry.tree_replay": ("STRUCTURAL_KINDS", "replay_tree"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvscope.telemetry' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ENDED_WITHOUT_CLOSING",
    "EVICTION_LOG_COLUMNS",
    "LEVELS",
    "MAX_RELATIVE_ERROR",
    "NULL_RECORDER",
    "REQUEST_LATENCIES",
    "STRUCTURAL_KINDS",
    "Capture",
    "CaptureError",
    "CensusBlock",
    "CopyKind",
    "Event",
    "EventKind",
    "EvictReason",
    "FaultKind",
    "Histogram",
    "LeakCheck",
    "ListRecorder",
    "LookupStop",
    "NodeRow",
    "NullRecorder",
    "PoolName",
    "PoolTerms",
    "Recorder",
    "RequestRecord",
    "RequestStatus",
    "Retention",
    "Routing",
    "RunStatus",
    "SQLRecorder",
    "UsageSample",
    "Visibility",
    "allocs_of_requests",
    "decode_slots",
    "display_name",
    "display_status",
    "environment_fingerprint",
    "eviction_log",
    "eviction_summary",
    "evictions_over_steps",
    "held_locks",
    "in_flight",
    "install_signal_handlers",
    "link_name",
    "lookup_stops",
    "open_reader",
    "open_writer",
    "parse_duration_s",
    "parse_size_bytes",
    "recent_evictions",
    "replay_tree",
    "reuse_by_principal",
    "run_principals",
    "running_lengths",
    "save_ledger_checkpoint",
    "save_report",
    "slots_blob",
    "tenant_of",
    "visibility_changes",
]
