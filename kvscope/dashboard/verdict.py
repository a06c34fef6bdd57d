"""The run's leak verdict as the Overview states it, and the run's wall-clock length.

NOTE: the same rule as `kvscope check`:
    failed        any idle leak check failed, or the report stored with the run names leaks
    inconclusive  nothing failed, but the run did not finish (running, ended without closing,
                  interrupted, crashed, incomplete) or it never reached an idle check
    clean         the run finished and passed at least one idle check with nothing failing
An attached run (`kvscope attach`: a real engine watched from outside) is never any of these:
its verdict is "not known" (attached_verdict), because the engine runs its own leak check.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import pandas as pd

from kvscope.dashboard.attached import VERDICT_LINE, VERDICT_TITLE
from kvscope.debug import LeakReport, check_reason
from kvscope.telemetry import LeakCheck, RunStatus

Level = Literal["clean", "failed", "inconclusive", "not known"]
TERMS = ("total", "available", "evictable", "protected", "held", "uncached")


class Verdict(NamedTuple):
    level: Level
    title: str
    lines: list[str]  # the failing checks' own messages, whole, one per pool


def leak_verdict(checks: pd.DataFrame, status: str, error: str | None = None,
                 report: LeakReport | None = None) -> Verdict:
    """`checks`: the run's leak_checks rows; `status`: its display status; `report`: the leak
    report stored with the run, when there is one."""
    failed = checks[~checks["ok"].astype(bool)] if not checks.empty else checks
    ledger = [] if report is None or report.clean or not report.leaks else [f"slot ledger: {check_reason(report)}"]
    if not failed.empty:
        first = int(failed["step"].min())
        later = failed["step"].nunique() - 1
        title = f"Leak check FAILED at step {first}" + (f" (and {later} later checks)" if later else "")
        lines = [line for row in failed[failed["step"] == first].itertuples() for line in _messages(row)]
        return Verdict("failed", title, lines + ledger)
    if ledger:
        return Verdict("failed", "Leaks found by the slot ledger", ledger)
    num_checks = int(checks["step"].nunique()) if not checks.empty else 0
    if status != RunStatus.FINISHED:
        return Verdict("inconclusive", f"Inconclusive: {_unfinished(status, error)}; {_checks(num_checks)} "
                       "balanced so far", [])
    if num_checks == 0:
        return Verdict("inconclusive", "Inconclusive: the run finished without reaching an idle leak check", [])
    return Verdict("clean", f"Clean: {_checks(num_checks)} balanced (the last at step {int(checks['step'].max())})",
                   [])


def attached_verdict() -> Verdict:
    """An attached engine's verdict: never clean, kvscope cannot balance another engine's pool."""
    return Verdict("not known", VERDICT_TITLE, [VERDICT_LINE])


def _unfinished(status: str, error: str | None) -> str:
    reasons = {
        RunStatus.RUNNING.value: "the run is still running",
        RunStatus.INTERRUPTED.value: "the run was interrupted",
        RunStatus.CRASHED.value: "the run crashed",
        RunStatus.INCOMPLETE.value: "the capture is incomplete",
    }
    reason = reasons.get(status, f"the run {status}")
    return f"{reason} ({error})" if error else reason


def _messages(row: Any) -> list[str]:
    """A failing check's own message, and its held lock when the message names only the gap."""
    total, available, evictable, protected, held, uncached = (int(getattr(row, t)) for t in TERMS)
    check = LeakCheck(int(row.step), str(row.pool), total, available, evictable, protected, held, uncached)
    message = row.message if isinstance(row.message, str) and row.message else check.message()
    if check.protected and not check.balanced:
        return [message, f"[{check.pool}] {check.protected} tokens still locked at an idle point"]
    return [message]


def _checks(num: int) -> str:
    return f"{num} idle leak check{'' if num == 1 else 's'}"


def run_seconds(run: Any) -> float | None:
    """Wall-clock seconds from the run's start to its end (or its last heartbeat while it has
    none); None when neither is known."""
    end = _number(run.ended_at)
    end = _number(run.heartbeat_at) if end is None else end
    start = _number(run.started_at)
    return None if end is None or start is None else max(0.0, end - start)


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number
