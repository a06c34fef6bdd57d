"""Retention's cost (docs/captures.md, "Retention"): the recorder's sustained events/s into SQLite with no
bound, under a size bound small enough that the writer's retention passes drop chunks all along, and
under the same bound gated on the ledger with the checkpointer process replaying beside it.

    .venv/bin/python benchmarks/bench_retention.py [--events N] [--rounds R] [--bound-mib B] [--no-write]

NOTE: cases, alternating round by round (the machine's load moves all three alike); each writes a fresh
SQLite file in its own temporary directory; events/s = N / (first record -> close() returned)
    unbounded    SQLRecorder with no retention (what `kvscope run` does by default)
    bounded      Retention(max_bytes=B): a pass after each commit, dropping the oldest chunks (attach
                 and the probe: no ledger gate)
    gated        Retention(max_bytes=B, gated=True) and the checkpointer (`python -m
                 kvscope.debug.checkpoint`, every CHECKPOINT_EVERY_S), as serve and run start it: drops
                 wait for its checkpoints; its CPU seconds (/proc/PID/stat, read before it is stopped)
                 per event it replayed are its cost
After each unbounded round, a checkpointer round over that whole capture in this process (CPU time):
the events its replay folds per CPU second, the rate it must beat to keep up with a writer.
The events are a consistent slot life, so the ledger replays them as it does an engine's: each step
allocates ALLOCS_PER_STEP blocks of SLOTS_PER_BLOCK slots for as many requests and frees those
allocated HOLD_STEPS steps before, its request ids recurring (each new id is a string the run keeps
for life, as its requests: unique ids filled a 16 MiB bound by themselves). bench_recorder.py's
random mixed events free slots never allocated: every free is a ledger finding, and the
checkpointer never caught up. After each round
the file is checked: a bounded case must have dropped chunks and stayed under its bound.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from _results import Figure, this_run, write_figures
from bench_recorder import fmt_rate

from kvscope.app.checkpointer import start_checkpointer, stop_checkpointer
from kvscope.debug.checkpoint import Followed
from kvscope.debug.replay import Replay
from kvscope.debug.report import ReportState
from kvscope.telemetry import Capture, EventKind, PoolName, Retention, open_writer
from kvscope.telemetry.recorder import SQLRecorder

DEFAULT_NUM_EVENTS = 1_000_000
DEFAULT_ROUNDS = 3
DEFAULT_BOUND_MIB = 8
CHECKPOINT_EVERY_S = 0.5
CASES = ("unbounded", "bounded", "gated")
ALLOCS_PER_STEP = 50
SLOTS_PER_BLOCK = 8
HOLD_STEPS = 10
EVENTS_PER_STEP = 2 * ALLOCS_PER_STEP  # NOTE: once HOLD_STEPS steps have passed
ABOUT = (
    "Retention's cost: the recorder's sustained events/s into SQLite with no bound, under a size bound its "
    "writer's passes keep (dropping chunks all along), and gated on the ledger with the checkpointer beside it; "
    "the checkpointer's CPU per event it replays."
)


class Round(NamedTuple):
    case: str
    events_per_s: float
    file_bytes: int
    dropped_chunks: int
    checkpointer_cpu_s: float = 0.0
    replayed_events: int = 0
    fold_events_per_cpu_s: float = 0.0  # NOTE: unbounded: one checkpointer round over the whole capture


def cpu_s_of(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def blocks() -> list[list[np.ndarray]]:
    """The slots of each request of a step, for HOLD_STEPS + 1 steps in turn (then reused)."""
    return [
        [np.arange(SLOTS_PER_BLOCK) + SLOTS_PER_BLOCK * (ALLOCS_PER_STEP * turn + j) for j in range(ALLOCS_PER_STEP)]
        for turn in range(HOLD_STEPS + 1)
    ]


def produce(recorder: SQLRecorder, num_steps: int) -> int:
    """The slot life (module NOTE); returns the events recorded."""
    slots, record, turns, count = blocks(), recorder.record, HOLD_STEPS + 1, 0
    for step in range(num_steps):
        recorder.step = step
        if step >= HOLD_STEPS:
            for j, freed in enumerate(slots[(step - HOLD_STEPS) % turns]):
                record(EventKind.FREE, pool=PoolName.FULL, rid=f"r{(step - HOLD_STEPS) % turns}-{j}", slots=freed)
            count += ALLOCS_PER_STEP
        for j, taken in enumerate(slots[step % turns]):
            record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{step % turns}-{j}", slots=taken)
        count += ALLOCS_PER_STEP
    return count


def one_round(case: str, num_events: int, bound_bytes: int) -> Round:
    num_steps = num_events // EVENTS_PER_STEP
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-retention-") as tmp:
        path = Path(tmp) / "c.db"
        retention = None if case == "unbounded" else Retention(max_bytes=bound_bytes, gated=case == "gated")
        recorder = SQLRecorder(path, retention=retention)
        recorder.wait_ready()
        checkpointer = None
        if case == "gated":
            os.environ["KVSCOPE_CHECKPOINT_EVERY_S"] = str(CHECKPOINT_EVERY_S)
            checkpointer = start_checkpointer(path, retention, recorder.run_id)
        start_s = time.perf_counter()
        recorded = produce(recorder, num_steps)
        recorder.close()
        elapsed_s = time.perf_counter() - start_s
        cpu_s = cpu_s_of(checkpointer.pid) if checkpointer is not None and checkpointer.poll() is None else 0.0
        stop_checkpointer(checkpointer)
        dropped, replayed = read_back(path)
        file_bytes = path.stat().st_size
        fold_rate = fold_events_per_cpu_s(path, recorder.run_id) if case == "unbounded" else 0.0
    if case != "unbounded" and (dropped == 0 or file_bytes > bound_bytes):
        raise SystemExit(f"{case}: {dropped} chunks dropped, file {file_bytes:,} bytes against {bound_bytes:,}")
    return Round(case, recorded / elapsed_s, file_bytes, dropped, cpu_s, replayed, fold_rate)


def fold_events_per_cpu_s(path: Path, run_id: int) -> float:
    """A checkpointer's first round over the whole closed capture, in this process: events its
    replay folds (and stores) per CPU second."""
    followed = Followed(ReportState(Replay(run_id)))
    capture, engine = Capture(path), open_writer(path)
    try:
        start_s = time.process_time()
        followed.round(capture, engine)
        cpu_s = time.process_time() - start_s
    finally:
        capture.close()
        engine.dispose()
    return (followed.saved_seq + 1) / cpu_s


def read_back(path: Path) -> tuple[int, int]:
    """Chunks dropped and events the stored checkpoint covers (0 when none)."""
    conn = sqlite3.connect(path)
    try:
        dropped = conn.execute("SELECT coalesce(sum(dropped_chunks), 0) FROM event_retention").fetchone()[0]
        through = conn.execute("SELECT coalesce(max(through_seq), -1) FROM ledger_checkpoints").fetchone()[0]
    finally:
        conn.close()
    return int(dropped), int(through) + 1


def figures(rounds: list[Round], bound_mib: float) -> list[Figure]:
    rates = {case: [r.events_per_s for r in rounds if r.case == case] for case in CASES}
    median = {case: statistics.median(values) for case, values in rates.items()}
    gated = [r for r in rounds if r.case == "gated"]
    per_event = [r.checkpointer_cpu_s / r.replayed_events * 1e6 for r in gated if r.replayed_events]
    listed = {case: ", ".join(fmt_rate(v) for v in values) for case, values in rates.items()}
    rows = [
        Figure("sustained events/s, no bound", f"{fmt_rate(median['unbounded'])} events/s ({listed['unbounded']})"),
        Figure(
            f"sustained events/s, a {bound_mib:g} MiB bound (retention passes dropping)",
            f"{fmt_rate(median['bounded'])} events/s ({listed['bounded']}); "
            f"{median['bounded'] / median['unbounded']:.2f}x of no bound",
        ),
        Figure(
            f"sustained events/s, a {bound_mib:g} MiB bound gated on the ledger, checkpointer beside",
            f"{fmt_rate(median['gated'])} events/s ({listed['gated']}); "
            f"{median['gated'] / median['unbounded']:.2f}x of no bound",
        ),
    ]
    folds = [r.fold_events_per_cpu_s for r in rounds if r.case == "unbounded"]
    rows.append(
        Figure(
            "checkpointer's replay (ledger fold and stored checkpoints) of a whole unbounded capture, one round "
            "in-process: events folded per CPU second",
            f"{fmt_rate(statistics.median(folds))} ({', '.join(fmt_rate(v) for v in folds)})",
        )
    )
    cpu = ", ".join(f"{r.checkpointer_cpu_s:.2f}" for r in gated)
    covered = ", ".join(f"{r.replayed_events:,}" for r in gated)
    rows.append(
        Figure(
            f"checkpointer beside the gated writer (a checkpoint every {CHECKPOINT_EVERY_S:g} s): CPU s, and the "
            "events its last stored checkpoint covers, per round",
            f"{cpu} s CPU; covered {covered} events"
            + (
                f"; {statistics.median(per_event):.2f} µs CPU per event covered "
                f"({fmt_rate(1e6 / statistics.median(per_event))} events folded per CPU second)"
                if per_event
                else ""
            ),
        )
    )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=DEFAULT_NUM_EVENTS)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--bound-mib", type=float, default=DEFAULT_BOUND_MIB)
    parser.add_argument("--write", action=argparse.BooleanOptionalAction, default=True, help="set RESULTS.md's rows")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    bound_bytes = int(args.bound_mib * 2**20)
    loads, rounds = [], []
    for number in range(args.rounds):
        for case in CASES:
            loads.append(os.getloadavg()[0])
            done = one_round(case, args.events, bound_bytes)
            rounds.append(done)
            print(
                f"round {number + 1} {case:<9} {fmt_rate(done.events_per_s):>8} events/s, file "
                f"{done.file_bytes / 2**20:.1f} MiB, {done.dropped_chunks} chunks dropped, checkpointer "
                f"{done.checkpointer_cpu_s:.2f} s CPU over {done.replayed_events:,} events"
                + (
                    f"; a replay folds {fmt_rate(done.fold_events_per_cpu_s)}/CPU s"
                    if done.fold_events_per_cpu_s
                    else ""
                ),
                flush=True,
            )
    rows = figures(rounds, args.bound_mib)
    for row in rows:
        print(f"| {row.name} | {row.value} |")
    if args.write:
        load = f"load average {min(loads):.1f}-{max(loads):.1f} (1 min) during the rounds"
        write_figures("bench_retention", ABOUT, rows, this_run(load=load))


if __name__ == "__main__":
    sys.exit(main())
