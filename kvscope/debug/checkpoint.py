"""The ledger checkpointer: a process beside a run with bounded retention that replays the run's
events as they are written and stores the ledger's state (ledger_state.py) every few seconds, so
the writer may drop the events it covers (telemetry/retention.py, the gate) and a later replay
starts from it with the same verdict and culprits.

    python -m kvscope.debug.checkpoint CAPTURE [--run ID ...] [--every SECONDS] [--parent PID]

NOTE: which runs it follows: the given ones, or every running run at level full with a retention
row (a `kvscope serve --dp-size N` records N of them), from the moment its bound is a quarter used
(START_SHARE: the capture's size, or the run's age against its window): until then nothing can be
dropped soon and it only looks every few seconds, so a server far under its bound pays nothing.
It replays from the run's first event then (the writer drops nothing a checkpoint does not cover).
It ends when every run it follows has closed and the parent process (the verb that started it) is
gone; the verb stops it before its capture closes. It reads the capture and writes only
ledger_checkpoints rows; when it cannot follow a run (its events were dropped past the checkpoint:
the size bound won) it says so in one line and stops following it, and readers then find the
checkpoint short of the run's first kept event.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from kvscope.debug import ledger_state
from kvscope.debug.replay import EventsDropped, Replay
from kvscope.debug.report import ReportState, _bisect_onset
from kvscope.telemetry import Capture, CaptureError, RunStatus, open_writer, save_ledger_checkpoint
from kvscope.telemetry.queries import pid_alive
from kvscope.telemetry.store import file_of

EVERY_S = 2.0
SAVE_EVERY_S = 1.0  # NOTE: within a long round (a first replay catching up), a checkpoint this often
START_SHARE = 0.25


@dataclass
class Followed:
    """One run's replay and the last event its stored checkpoint covers."""

    state: ReportState
    saved_seq: int = -1
    done: bool = False
    note: str | None = None

    def round(self, capture: Capture, engine: Engine) -> None:
        """Replay what is new; store the state when it moved, and on the way every SAVE_EVERY_S
        (a first replay that catches up with a long run lets the writer drop as it goes)."""
        replay, saved_s = self.state.replay, time.monotonic()

        def save_on_the_way(_done: int) -> None:
            nonlocal saved_s
            if time.monotonic() - saved_s >= SAVE_EVERY_S:
                self._save(engine)
                saved_s = time.monotonic()

        try:
            replay.advance(capture, self.state.after_step, on_progress=save_on_the_way)
        except EventsDropped as dropped:
            self.done, self.note = True, f"run {replay.run_id}: {dropped}"
            return
        self._save(engine)

    def _save(self, engine: Engine) -> None:
        self._compress()
        replay = self.state.replay
        ledger = replay.ledger
        if ledger.last_seq > self.saved_seq:
            extra = {"current": replay.current, "onset": _bisect_onset(self.state.series)}
            body = ledger_state.encode(ledger, extra)
            save_ledger_checkpoint(
                engine,
                replay.run_id,
                ledger.last_seq,
                -1 if replay.current is None else int(replay.current),
                ledger_state.FORMAT,
                body,
            )
            self.saved_seq = ledger.last_seq

    def _compress(self) -> None:
        """NOTE: the 'broken so far' series is monotone (once broken, broken), so its first broken
        step alone keeps the onset; the replay's own onset_before carries it across a resume."""
        series = self.state.series
        onset = _bisect_onset(series)
        before = self.state.replay.onset_before
        if before is not None and (onset is None or before < onset):
            onset = before
        self.state.series = [] if onset is None else [(onset, True)]


@dataclass
class Checkpointer:
    target: str
    runs: list[int] | None = None  # None: every gated run that records
    parent_pid: int | None = None
    max_bytes: int | None = None  # NOTE: the bounds it was started for: nothing is due before a quarter
    keep_s: float | None = None
    started_s: float = field(default_factory=time.monotonic)
    followed: dict[int, Followed] = field(default_factory=dict)
    engine: Engine | None = None  # NOTE: the one writing connection, for the process's life

    def close(self) -> None:
        if self.engine is not None:
            self.engine.dispose()
            self.engine = None

    def _running(self, capture: Capture) -> set[int]:
        runs = capture.runs()
        running = runs[(runs.display_status == RunStatus.RUNNING) & (runs.level == "full")]
        ids = {int(i) for i in running.id}
        if self.runs is not None:
            return ids & set(self.runs)
        kept = capture.retention()
        kept = kept[kept.run_id.isin(ids)]
        return {int(row.run_id) for row in kept.itertuples() if self._due(capture, row)}

    def _due(self, capture: Capture, kept: Any) -> bool:
        """The run's bound is a quarter used (or it is followed already)."""
        if int(kept.run_id) in self.followed:
            return True
        runs = capture.runs()
        started = float(runs[runs.id == kept.run_id].started_at.iloc[0])
        if pd.notna(kept.keep_events_s) and time.time() - started >= START_SHARE * float(kept.keep_events_s):
            return True
        if pd.isna(kept.max_bytes):
            return False
        path = file_of(self.target)
        if path is None:
            used = capture.event_bytes().get(int(kept.run_id), 0)
        else:
            used = sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())
        return used >= START_SHARE * float(kept.max_bytes)

    def idle(self) -> bool:
        """Nothing can be due yet: no run followed, a capture file under a quarter of `max_bytes` and a
        quarter of `keep_s` not past (a stat, no read: an idle server's capture is not opened)."""
        if self.followed or (self.max_bytes is None and self.keep_s is None):
            return False
        if self.keep_s is not None and time.monotonic() - self.started_s >= START_SHARE * self.keep_s:
            return False
        path = file_of(self.target)
        if self.max_bytes is None or path is None:
            return self.max_bytes is None and path is not None
        size = sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())
        return size < START_SHARE * self.max_bytes

    def round(self) -> bool:
        """One pass over the runs; False once there is nothing left to follow."""
        if self.idle():
            return self.parent_pid is None or pid_alive(self.parent_pid)
        capture = Capture(self.target)  # NOTE: afresh each round: the chunks read once are not kept
        if self.engine is None:
            self.engine = open_writer(self.target)
        engine = self.engine
        try:
            running = self._running(capture)
            for run_id in running:
                self.followed.setdefault(run_id, Followed(ReportState(Replay(run_id))))
            for run_id, followed in self.followed.items():
                if not followed.done:
                    followed.round(capture, engine)
                    if followed.note is not None:
                        print(f"kvscope checkpoint: {followed.note}", file=sys.stderr, flush=True)
                        followed.note = None
                    followed.done = followed.done or run_id not in running
        finally:
            capture.close()
        waiting = any(not f.done for f in self.followed.values())
        return waiting or (self.parent_pid is not None and pid_alive(self.parent_pid))


def _round(checkpointer: Checkpointer, said: set[str]) -> bool:
    """One round; a failed one (the database busy past its timeout, a chunk dropped while it was read)
    is said once per kind of failure and tried again next round: the replay applied whole events."""
    try:
        return checkpointer.round()
    except (CaptureError, SQLAlchemyError, ValueError, OSError) as err:
        kind = type(err).__name__
        if kind not in said:
            said.add(kind)
            print(f"kvscope checkpoint: a round failed, trying again: {err}".splitlines()[0], file=sys.stderr)
        return checkpointer.parent_pid is None or pid_alive(checkpointer.parent_pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvscope.debug.checkpoint")
    parser.add_argument("capture")
    parser.add_argument("--run", type=int, action="append", help="follow this run (default: every gated run)")
    parser.add_argument("--every", type=float, default=EVERY_S, help="seconds between checkpoints")
    parser.add_argument("--parent", type=int, help="stop when this process is gone and no run is left")
    parser.add_argument("--max-bytes", type=int, help="the runs' size bound (nothing is due before a quarter)")
    parser.add_argument("--keep-s", type=float, help="the runs' window (nothing is due before a quarter)")
    args = parser.parse_args(argv)
    checkpointer = Checkpointer(args.capture, args.run, args.parent, args.max_bytes, args.keep_s)
    said: set[str] = set()
    try:
        while _round(checkpointer, said):
            time.sleep(args.every)
    except KeyboardInterrupt:
        return 0
    finally:
        checkpointer.close()
    return 0


if __name__ == "__main__":
    with suppress(BrokenPipeError):
        sys.exit(main())
