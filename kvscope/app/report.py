"""The verbs that read a capture: `runs`, `report leaks`, `check` and `diff`; and storing the
leak report in the capture when `kvscope run` closes it.

`report leaks` and `check` always replay the capture afresh (the stored report is the
dashboard's shortcut), with the ledger replay's progress on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from kvscope.app.progress import Progress
from kvscope.debug import LeakReport, ProgressHook, build_report, check_reason, render_diff, render_text, save_report
from kvscope.telemetry import Capture, CaptureError

PROGRESS_DELAY_S = 1.0  # a replay shorter than this shows no progress


def ledger_progress(progress: Progress) -> ProgressHook:
    """The ledger replay's progress hook: `replaying the slot ledger: 412,000 events, 4 s`."""

    def on_progress(num_events: int) -> None:
        if progress.due():
            progress.draw(f"replaying the slot ledger: {num_events:,} events, {progress.elapsed_s:.0f} s ")

    return on_progress


def replay_report(target: str | Path, run_id: int | None, err: TextIO = sys.stderr) -> LeakReport:
    """The leak report of a run, replayed afresh, with progress on `err`."""
    progress = Progress(err, delay_s=PROGRESS_DELAY_S)
    try:
        return build_report(target, run_id, on_progress=ledger_progress(progress))
    finally:
        progress.close()


def store_leak_report(path: Path, run_id: int, err: TextIO = sys.stderr) -> str:
    """Build the leak report of the run just closed and store it in the capture, so the
    dashboard and `report leaks` need not replay the events again. Returns the verdict line."""
    try:
        report = replay_report(path, run_id, err)
        save_report(path, report)
    except (CaptureError, ValueError) as exc:
        return f"not stored ({exc})"
    return f"{check_reason(report)} (stored in the capture)"


def runs_verb(args: argparse.Namespace) -> int:
    capture = Capture(args.capture)
    frame = capture.runs()
    capture.close()
    if frame.empty:
        print(f"{args.capture}: no runs recorded")
        return 0
    print(f"{'id':>4}  {'status':<22} {'level':<8} {'started (UTC)':<20} {'seconds':>8}  label")
    for row in frame.itertuples():
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row.started_at))
        end = row.ended_at if row.ended_at == row.ended_at and row.ended_at is not None else row.heartbeat_at
        print(f"{row.id:>4}  {row.display_status:<22} {row.level:<8} {started:<20} {end - row.started_at:>8.1f}  "
              f"{row.label}")
    return 0


def report_verb(args: argparse.Namespace) -> int:
    report = replay_report(args.capture, args.run)
    print(report.to_json() if args.json else render_text(report))
    return 0


def check_verb(args: argparse.Namespace) -> int:
    """Exit 0 clean, 1 on a leak or a broken invariant (2, unreadable, comes from cli.main)."""
    report = replay_report(args.capture, args.run)
    print(f"{args.capture}: {check_reason(report)}")
    return 0 if report.clean else 1


def diff_verb(args: argparse.Namespace) -> int:
    print(render_diff(args.a, args.b))
    return 0
