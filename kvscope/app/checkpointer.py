"""The ledger checkpointer beside a recording verb (kvscope/debug/checkpoint.py): started with a run
whose retention is gated on the ledger, stopped before its capture closes (a reader left open would
keep the capture's -wal beside it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvscope.telemetry import Retention

STOP_WAIT_S = 5.0


def start_checkpointer(
    target: str | Path, retention: Retention | None, run_id: int | None = None
) -> subprocess.Popen[bytes] | None:
    """The checkpointer of `run_id` (None: every gated run that records into `target`), or None when
    no run needs one (no bound, or a verdict that needs no ledger)."""
    if retention is None or not retention.bounded or not retention.gated:
        return None
    command = [sys.executable, "-m", "kvscope.debug.checkpoint", str(target), "--parent", str(os.getpid())]
    if run_id is not None:
        command += ["--run", str(run_id)]
    if retention.max_bytes is not None:
        command += ["--max-bytes", str(retention.max_bytes)]
    if retention.keep_events_s is not None:
        command += ["--keep-s", str(retention.keep_events_s)]
    every = os.environ.get("KVSCOPE_CHECKPOINT_EVERY_S")
    if every:
        command += ["--every", every]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)


def stop_checkpointer(process: subprocess.Popen[bytes] | None) -> None:
    """End it (a checkpoint it was writing is rolled back whole) and wait for it."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
