"""The run's leak verdict as the pages state it, and the run's wall-clock length.

NOTE: the verdict is `kvscope check`'s, word for word (kvscope.debug.verdict on the run's leak
report): leak, inconclusive (the run did not finish, or never reached an idle check) or clean
(it finished, passed at least one idle check, and nothing failed). The pages add the failing
checks' own messages under it. An attached run (`kvscope attach`: a real engine watched from
outside) is never any of these: its verdict is "not known" (attached_verdict), because the
engine runs its own leak check.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import pandas as pd
import streamlit as st

from kvscope.dashboard.attached import VERDICT_LINE, VERDICT_TITLE
from kvscope.debug import LeakKind, LeakReport, verdict
from kvscope.telemetry import LeakCheck

Level = Literal["clean", "failed", "inconclusive", "not known"]
LEVELS: dict[str, Level] = {"clean": "clean", "leak": "failed", "inconclusive": "inconclusive"}
TERMS = ("total", "available", "evictable", "protected", "held", "uncached")


class Verdict(NamedTuple):
    level: Level
    title: str
    lines: list[str]  # the failing checks' own messages, whole, one per pool


def leak_verdict(report: LeakReport, checks: pd.DataFrame) -> Verdict:
    """`report`: the run's leak report (its verdict is kvscope check's); `checks`: its leak_checks
    rows, whose failing messages are shown whole under the verdict."""
    check = verdict(report)
    failed = checks[~checks["ok"].astype(bool)] if not checks.empty else checks
    if failed.empty:
        return Verdict(LEVELS[check.verdict], check.reason, [])
    first = int(failed["step"].min())
    later = failed["step"].nunique() - 1
    head = f"idle leak check failed at step {first}" + (f" (and {later} later checks)" if later else "") + ":"
    lines = [line for row in failed[failed["step"] == first].itertuples() for line in _messages(row)]
    return Verdict(LEVELS[check.verdict], check.reason, [head, *lines])


BOXES = {"clean": st.success, "failed": st.error, "inconclusive": st.warning, "not known": st.info}


def show_verdict(shown: Verdict) -> None:
    """The verdict whole, in its colour: the failing checks' own messages on lines of their own."""
    body = "\n\n".join([f"**{shown.title}**", *(f"`{line}`" for line in shown.lines)])
    BOXES[shown.level](body)


def protected_help(pool: str, step: int, num_running: int, checks: pd.DataFrame, report: LeakReport) -> str:
    """What the protected tokens of `pool` at `step` are locked by. "Never released" only where
    the leak report names such a lock: with no request running, a hiradix copy still in flight
    holds its nodes locked until the idle check waits for it."""
    if num_running:
        return "cached in the tree and locked: by a running request (or a host-tier copy in flight)"
    never = sum(1 for leak in report.leaks if leak.kind == LeakKind.LOCK_NEVER_RELEASED and leak.pool == pool)
    if never:
        return (
            f"cached in the tree and locked with no request running: the leak report names {never} lock(s) "
            "that were never released (see Leaks)"
        )
    at = checks[(checks["step"] == step) & (checks["pool"] == pool)] if not checks.empty else checks
    if not at.empty and int(at["protected"].iloc[0]) == 0:
        return (
            f"cached in the tree and locked when this sample was taken, with no request running: by host-tier "
            f"copies still in flight. The idle leak check of step {step}, once they were done, found none locked"
        )
    return (
        "cached in the tree and locked with no request running: by a host-tier copy in flight, or a lock not "
        "released (no leak report names one; see Leaks)"
    )


def attached_verdict() -> Verdict:
    """An attached engine's verdict: never clean, kvscope cannot balance another engine's pool."""
    return Verdict("not known", VERDICT_TITLE, [VERDICT_LINE])


def _messages(row: Any) -> list[str]:
    """A failing check's own message, and its held lock when the message names only the gap."""
    total, available, evictable, protected, held, uncached = (int(getattr(row, t)) for t in TERMS)
    check = LeakCheck(int(row.step), str(row.pool), total, available, evictable, protected, held, uncached)
    message = row.message if isinstance(row.message, str) and row.message else check.message()
    if check.protected and not check.balanced:
        return [message, f"[{check.pool}] {check.protected} tokens still locked at an idle point"]
    return [message]


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
