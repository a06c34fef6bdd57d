"""The memory debugger: the slot-ownership ledger, its replay from a capture, leak reports and
checks, capture diffs, and the live monitor.

It reads captures through kvscope.telemetry only.

NOTE: the live monitor (DebugMonitor) poisons freed K/V in torch tensors, so it loads torch: it
is imported on first use, and the dashboard (which shows reports) never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvscope.debug.diff import render_diff, summarize
from kvscope.debug.ledger import APPLY_COLUMNS, IGNORED_KINDS, Ledger
from kvscope.debug.replay import ProgressHook, Replay, StepHook, replay
from kvscope.debug.report import (
    Leak,
    LeakKind,
    LeakReport,
    ReportState,
    Verdict,
    build_report,
    check_reason,
    checks_report,
    render_text,
    save_report,
    stored_report,
    verdict,
)

if TYPE_CHECKING:
    from kvscope.debug.monitor import DebugMonitor


def __getattr__(name: str) -> Any:
    if name == "DebugMonitor":
        from kvscope.debug.monitor import DebugMonitor

        return DebugMonitor
    raise AttributeError(f"module 'kvscope.debug' has no attribute {name!r}")


__all__ = [
    "APPLY_COLUMNS",
    "IGNORED_KINDS",
    "DebugMonitor",
    "Leak",
    "LeakKind",
    "LeakReport",
    "Ledger",
    "ProgressHook",
    "Replay",
    "ReportState",
    "StepHook",
    "Verdict",
    "build_report",
    "check_reason",
    "checks_report",
    "render_diff",
    "render_text",
    "replay",
    "save_report",
    "stored_report",
    "summarize",
    "verdict",
]
