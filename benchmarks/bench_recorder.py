"""Recorder into SQLite at level full: sustained events/s, and the cost of record() on the caller's thread.

    .venv/bin/python benchmarks/bench_recorder.py [--events N] [--rounds R] [--quick] [--profile] [--no-write]

Prints Markdown tables; with --write (the default) also sets its rows in the
`## bench_recorder` table of benchmarks/RESULTS.md. `--profile` then profiles the writer's packing of one
buffer (at most PROFILE_NUM_EVENTS) in this process with cProfile and prints its top
functions to stderr.

NOTE: cases; each writes a fresh SQLite file in its own temporary directory, and what it holds
is checked after timing (count, total slot bytes and total num_tokens of the packed events)
    caller     N = M / 10 record() calls of one event, timed on the caller's thread in
               NUM_CHUNKS chunks, the writer paused (flush_interval_s and flush_max_events too
               large to fire before close); and the record loops of the two cases below
    sustained  M mixed events through record() with the default settings, as fast as the
               loop goes; events/s = M / (first record -> close() returned, all on disk). The
               record loop includes the hand-offs to the writer process (marshal and send)
               and any wait for it (back-pressure); its CPU time is the caller's cost
    requests   the sustained case with REQUESTS_PER_STEP finished requests' records (recorder.request)
               a step as well, built before timing: what the requests table and the request sums
               (schema 12, folded by the writer) cost the writer per event
    writer     the same M events recorded with the writer paused, then one timed flush()
               (hand-off, the writer process's packing and writing, its acknowledgement)
    raw        sqlite3 executemany of the same M events as rows of the layout before schema 6
               (slots as int32 bytes), one transaction, WAL + synchronous=NORMAL: the events table
               (a) with the secondary indexes kept while recording (step, kind; its rid and
               node indexes were built at close), (b) without them (the (run_id, seq) primary
               key keeps its automatic index), (c) as a plain rowid table with no index
The sustained, requests and writer cases run --rounds times, alternating; the tables show medians.
The mixed events repeat a fixed set of NUM_TEMPLATE_STEPS steps x EVENTS_PER_STEP events
(built before timing; recorder.step advances every EVENTS_PER_STEP events): KIND_SHARES of
each kind, alloc/free with 1-32 slots (int64 numpy arrays), the rest without slots.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import marshal
import pstats
import resource
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import sqlalchemy
from _results import Figure, command_line, machine, this_run, write_figures
from sqlalchemy.schema import CreateIndex, CreateTable

from kvscope.telemetry import NULL_RECORDER, EventKind, PoolName, schema
from kvscope.telemetry.packed import Packer, widen
from kvscope.telemetry.recorder import SQLRecorder, slots_blob
from kvscope.telemetry.records import RequestRecord

DEFAULT_NUM_EVENTS = 2_000_000
DEFAULT_ROUNDS = 3
QUICK_NUM_EVENTS = 400_000
PROFILE_NUM_EVENTS = 500_000
NUM_CHUNKS = 10
EVENTS_PER_STEP = 100
NUM_TEMPLATE_STEPS = 200
KIND_SHARES = {
    EventKind.ALLOC: 0.2,
    EventKind.FREE: 0.2,
    EventKind.MATCH: 0.15,
    EventKind.INSERT: 0.15,
    EventKind.LOCK: 0.15,
    EventKind.UNLOCK: 0.15,
}
SLOTTED_KINDS = (EventKind.ALLOC, EventKind.FREE)
MAX_SLOTS = 32
REQUESTS_PER_STEP = 3  # NOTE: a finished request per 33 events (the probe's captures: about one per 29)
NUM_RIDS = 1000
NUM_NODES = 20_000
PAUSED = {"flush_interval_s": 3600.0, "flush_max_events": 1 << 62}
TARGET_EVENTS_PER_S = 1_000_000
TARGET_CALLER_NS = 500
RAW_KINDS = {
    "a": "row layout (before schema 6): events table, its live indexes (step, kind)",
    "b": "row layout, no secondary index (PK index kept)",
    "c": "row layout as a rowid table, no index at all",
}


class Args(NamedTuple):
    """One record() call's arguments (besides the step)."""

    kind: EventKind
    pool: PoolName | None
    rid: str | None
    node_id: int | None
    num_tokens: int
    slots: np.ndarray | None
    aux: int


class Expected(NamedTuple):
    num_events: int
    num_slot_bytes: int
    num_tokens: int


class CallerFigure(NamedTuple):
    key: str
    label: str
    num_events: int
    ns_per_event: float  # all calls: total time / num_events, garbage-collector pauses included
    median_chunk_ns: float | None  # per event, over NUM_CHUNKS equal chunks of the calls
    max_chunk_ns: float | None


class Throughput(NamedTuple):
    label: str
    num_events: int
    record_s: float  # the record() loop (0 for raw)
    write_s: float  # close() for sustained, flush() for writer, executemany + commit for raw
    record_cpu_s: float = 0.0  # CPU time of this process in the record loop
    writer_cpu_s: float = 0.0  # CPU time of the writer process, start to exit (0 for raw)

    @property
    def events_per_s(self) -> float:
        return self.num_events / (self.record_s + self.write_s)


def median_throughput(rounds: list[Throughput]) -> Throughput:
    """Field by field, the median over rounds (events/s is then the median round's figure)."""
    best = sorted(rounds, key=lambda r: r.events_per_s)[len(rounds) // 2]
    return best._replace(
        record_cpu_s=statistics.median(r.record_cpu_s for r in rounds),
        writer_cpu_s=statistics.median(r.writer_cpu_s for r in rounds),
    )


def writer_started_cpu_s(recorder: SQLRecorder) -> float:
    """CPU seconds the writer process took to start (Linux: /proc/PID/schedstat, ns on a CPU)."""
    with open(f"/proc/{recorder.writer_pid}/schedstat") as fh:
        return int(fh.read().split()[0]) / 1e9


def children_cpu_s() -> float:
    """CPU seconds of this process's ended and waited-for children (the recorders' writers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- the events --------------------------------------------------------------------------


def template_steps(seed: int) -> list[list[Args]]:
    rng = np.random.default_rng(seed)
    kinds = list(KIND_SHARES)
    shares = np.array(list(KIND_SHARES.values()))
    steps = []
    for _ in range(NUM_TEMPLATE_STEPS):
        picks = rng.choice(len(kinds), size=EVENTS_PER_STEP, p=shares / shares.sum())
        steps.append([template_event(kinds[i], rng) for i in picks])
    return steps


def template_event(kind: EventKind, rng: np.random.Generator) -> Args:
    rid = f"req-{rng.integers(NUM_RIDS)}"
    if kind in SLOTTED_KINDS:
        slots = rng.integers(0, 1 << 20, size=int(rng.integers(1, MAX_SLOTS, endpoint=True)))
        return Args(kind, PoolName.FULL, rid, None, len(slots), slots, 0)
    node_id, num_tokens, aux = (int(x) for x in rng.integers(0, NUM_NODES, size=3))
    return Args(kind, None, None if kind is EventKind.INSERT else rid, node_id, num_tokens % 512, None, aux)


def expected_of(steps: list[list[Args]], num_steps: int) -> Expected:
    per_step = [(sum(4 * len(a.slots) for a in s if a.slots is not None), sum(a.num_tokens for a in s)) for s in steps]
    picked = [per_step[i % len(steps)] for i in range(num_steps)]
    return Expected(num_steps * EVENTS_PER_STEP, sum(p[0] for p in picked), sum(p[1] for p in picked))


def produce(
    recorder: SQLRecorder, steps: list[list[Args]], num_steps: int, requests: list[RequestRecord] | None = None
) -> None:
    """The events; with `requests`, REQUESTS_PER_STEP of them recorded after each step's events."""
    record = recorder.record
    for step in range(num_steps):
        recorder.step = step
        for kind, pool, rid, node_id, num_tokens, slots, aux in steps[step % len(steps)]:
            record(kind, pool=pool, rid=rid, node_id=node_id, num_tokens=num_tokens, slots=slots, aux=aux)
        if requests is not None:
            for i in range(step * REQUESTS_PER_STEP, (step + 1) * REQUESTS_PER_STEP):
                recorder.request(requests[i])


def finished_requests(num_steps: int, seed: int) -> list[RequestRecord]:
    """REQUESTS_PER_STEP finished requests a step, each with its four moments (latencies for the sums)."""
    rng = np.random.default_rng(seed)
    found = []
    for i in range(num_steps * REQUESTS_PER_STEP):
        step = i // REQUESTS_PER_STEP
        arrive = step * 0.01
        waits = np.cumsum(rng.exponential(0.05, size=3)).tolist()
        times = {
            "arrive": arrive,
            "admit": arrive + waits[0],
            "first_token": arrive + waits[1],
            "finish": arrive + waits[2],
        }
        prompt = int(rng.integers(16, 2048))
        found.append(
            RequestRecord(
                f"req-{i}",
                f"tenant-{i % 7}",
                prompt,
                status="finished",
                cached_tokens=int(rng.integers(0, prompt)),
                output_len=int(rng.integers(1, 256)),
                times=times,
                steps={moment: step for moment in times},
            )
        )
    return found


def loop_alone_s(steps: list[list[Args]], num_steps: int) -> float:
    """CPU seconds of produce()'s own work, the same loop with no recorder and no call: what an
    engine does anyway, so not a cost of recording (best of three)."""

    class Steps:
        step = 0

    best = float("inf")
    for _ in range(3):
        holder = Steps()
        start_s = time.process_time()
        for step in range(num_steps):
            holder.step = step
            for _kind, _pool, _rid, _node_id, _num_tokens, _slots, _aux in steps[step % len(steps)]:
                pass
        best = min(best, time.process_time() - start_s)
    return best


def raw_rows(steps: list[list[Args]], num_steps: int) -> list[tuple[Any, ...]]:
    """The rows the writer binds for the same events (run_id 1, seq = position)."""
    bound = [
        [
            (
                a.kind.value,
                a.pool and a.pool.value,
                a.rid,
                a.node_id,
                a.num_tokens,
                a.aux,
                None,
                None,
                slots_blob(a.slots),
            )
            for a in s
        ]
        for s in steps
    ]
    t0 = time.monotonic()
    flat = ((step, row) for step in range(num_steps) for row in bound[step % len(steps)])
    return [(1, seq, step, t0 + seq * 1e-6, *row) for seq, (step, row) in enumerate(flat)]


# -- checks and helpers ------------------------------------------------------------------


def check_rows(db_path: Path, expected: Expected, num_requests: int = 0) -> None:
    """The capture holds exactly the events recorded: (events, slot bytes, tokens), from the
    packed chunks (or the events table of the raw cases); and `num_requests` requests, each in the
    request sums."""
    conn = sqlite3.connect(db_path)
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "event_chunks" in tables:
            events = conn.execute("SELECT coalesce(sum(num_events), 0) FROM event_chunks").fetchone()[0]
            slot_bytes = tokens = 0
            for name, dtype, data in conn.execute(
                "SELECT name, dtype, data FROM event_columns WHERE name IN ('slot_counts', 'num_tokens')"
            ):
                values = widen(name, dtype, data)
                if name == "slot_counts":
                    slot_bytes += 4 * int(np.maximum(values, 0).sum())
                else:
                    tokens += int(values.sum())
            found: tuple[int, ...] = (events, slot_bytes, tokens)
        else:
            found = tuple(
                conn.execute(
                    "SELECT count(*), coalesce(sum(length(slots)), 0), coalesce(sum(num_tokens), 0) FROM events"
                ).fetchone()
            )
        if num_requests:
            rows = conn.execute("SELECT count(*) FROM requests").fetchone()[0]
            summed = conn.execute("SELECT coalesce(sum(num_requests), 0) FROM request_sums").fetchone()[0]
            if (rows, summed) != (num_requests, num_requests):
                raise AssertionError(
                    f"{db_path.name}: {rows} request rows, {summed} in the sums, {num_requests} recorded"
                )
    finally:
        conn.close()
    if tuple(found) != tuple(expected):
        raise AssertionError(
            f"{db_path.name}: the capture has (events, slot bytes, tokens) = {tuple(found)}, expected {tuple(expected)}"
        )


@contextmanager
def fresh_db() -> Iterator[Path]:
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="bench_recorder-") as tmp:
        yield Path(tmp) / "capture.db"


# -- caller cost -------------------------------------------------------------------------


class CallerCase(NamedTuple):
    key: str
    label: str
    kind: EventKind
    gc_enabled: bool = True
    null: bool = False  # NULL_RECORDER: the call alone, no buffer, no database


CALLER_CASES = [
    CallerCase("alloc", "alloc, 16 slots, writer paused", EventKind.ALLOC),
    CallerCase("lock", "lock, no slots, writer paused", EventKind.LOCK),
    CallerCase("alloc-nogc", "alloc, 16 slots, writer paused, gc disabled", EventKind.ALLOC, gc_enabled=False),
    CallerCase("floor", "floor: NULL_RECORDER.record, alloc arguments", EventKind.ALLOC, null=True),
]


def caller_loop(record: Callable[..., None], kind: EventKind, num_events: int) -> list[float]:
    """Seconds of each of NUM_CHUNKS equal chunks of record() calls."""
    slots = np.arange(16, dtype=np.int64) if kind in SLOTTED_KINDS else None
    pool = PoolName.FULL if slots is not None else None
    node_id = None if slots is not None else 7
    chunks_s = []
    for _ in range(NUM_CHUNKS):
        start_s = time.perf_counter()
        for _ in range(num_events // NUM_CHUNKS):
            record(kind, pool=pool, rid="r1", node_id=node_id, num_tokens=16, slots=slots)
        chunks_s.append(time.perf_counter() - start_s)
    return chunks_s


def run_caller_case(case: CallerCase, num_events: int) -> CallerFigure:
    num_events -= num_events % NUM_CHUNKS
    if case.null:
        return caller_figure(case, num_events, caller_loop(NULL_RECORDER.record, case.kind, num_events))
    with fresh_db() as db_path:
        recorder = SQLRecorder(db_path, **PAUSED)
        if not case.gc_enabled:
            gc.disable()
        try:
            chunks_s = caller_loop(recorder.record, case.kind, num_events)
        finally:
            gc.enable()
        recorder.close()
        num_slot_bytes = 4 * 16 * num_events if case.kind in SLOTTED_KINDS else 0
        check_rows(db_path, Expected(num_events, num_slot_bytes, 16 * num_events))
    return caller_figure(case, num_events, chunks_s)


def caller_figure(case: CallerCase, num_events: int, chunks_s: list[float]) -> CallerFigure:
    chunks_ns = [chunk_s / (num_events // NUM_CHUNKS) * 1e9 for chunk_s in chunks_s]
    return CallerFigure(
        case.key, case.label, num_events, sum(chunks_s) / num_events * 1e9, statistics.median(chunks_ns), max(chunks_ns)
    )


# -- throughput --------------------------------------------------------------------------


def run_sustained(
    steps: list[list[Args]], num_steps: int, expected: Expected, requests: list[RequestRecord] | None = None
) -> Throughput:
    with fresh_db() as db_path:
        children_before = children_cpu_s()
        recorder = SQLRecorder(db_path)
        recorder.wait_ready()
        children_before += writer_started_cpu_s(recorder)
        start_s, start_cpu_s = time.perf_counter(), time.process_time()
        produce(recorder, steps, num_steps, requests)
        recorded_s, recorded_cpu_s = time.perf_counter(), time.process_time()
        recorder.close()
        closed_s = time.perf_counter()
        writer_cpu_s = children_cpu_s() - children_before
        check_rows(db_path, expected, 0 if requests is None else len(requests))
    return Throughput(
        "recorder, sustained (defaults): record loop + close()"
        if requests is None
        else f"recorder, sustained, and {REQUESTS_PER_STEP} finished requests a step",
        expected.num_events,
        recorded_s - start_s,
        closed_s - recorded_s,
        recorded_cpu_s - start_cpu_s,
        writer_cpu_s,
    )


def run_writer_only(steps: list[list[Args]], num_steps: int, expected: Expected) -> Throughput:
    """The flush's figure; its record_s is the record loop's, with the writer paused."""
    with fresh_db() as db_path:
        children_before = children_cpu_s()
        recorder = SQLRecorder(db_path, **PAUSED)
        recorder.wait_ready()
        children_before += writer_started_cpu_s(recorder)
        start_s, start_cpu_s = time.perf_counter(), time.process_time()
        produce(recorder, steps, num_steps)
        recorded_s, recorded_cpu_s = time.perf_counter(), time.process_time()
        recorder.flush()  # NOTE: returns once the writer process has written everything
        flushed_s = time.perf_counter()
        recorder.close()
        writer_cpu_s = children_cpu_s() - children_before
        check_rows(db_path, expected)
    return Throughput(
        "recorder, writer only: one flush() of the buffered events",
        expected.num_events,
        recorded_s - start_s,
        flushed_s - recorded_s,
        recorded_cpu_s - start_cpu_s,
        writer_cpu_s,
    )


def profile_writer(steps: list[list[Args]], num_steps: int) -> None:
    """The writer's work on one buffer (unmarshal and pack), in this process under cProfile."""
    with fresh_db() as db_path:
        recorder = SQLRecorder(db_path, **PAUSED)
        produce(recorder, steps, num_steps)
        body = marshal.dumps((recorder._items, []))
        recorder._items.clear()
        recorder.close()
    profiler = cProfile.Profile()
    profiler.enable()
    items, _ = marshal.loads(body)
    Packer().pack(items)
    profiler.disable()
    print("cProfile of the writer's unmarshal and pack of one buffer:", file=sys.stderr)
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(15)


def raw_ddl(variant: str) -> list[str]:
    dialect = sqlalchemy.create_engine("sqlite://").dialect
    table = str(CreateTable(schema.events).compile(dialect=dialect)).strip()
    if variant == "c":
        table = table.replace(", \n\tPRIMARY KEY (run_id, seq)", "")
        assert "PRIMARY KEY" not in table, table
    indexes = [str(CreateIndex(ix).compile(dialect=dialect)) for ix in schema.events.indexes]
    return [table, *(indexes if variant == "a" else [])]


def run_raw(variant: str, rows: list[tuple[Any, ...]], expected: Expected) -> Throughput:
    columns = schema.EVENT_COLUMNS
    sql = f"INSERT INTO events ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
    with fresh_db() as db_path:
        conn = sqlite3.connect(db_path)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        for ddl in raw_ddl(variant):
            conn.execute(ddl)
        conn.commit()
        start_s = time.perf_counter()
        with conn:  # one transaction
            conn.executemany(sql, rows)
        write_s = time.perf_counter() - start_s
        conn.close()
        check_rows(db_path, expected)
    return Throughput(f"raw sqlite3 executemany ({variant}): {RAW_KINDS[variant]}", len(rows), 0.0, write_s)


# -- report ------------------------------------------------------------------------------


def fmt_rate(rate: float) -> str:
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if rate >= scale:
            return f"{rate / scale:.2f}{suffix}"
    return f"{rate:.1f}"


def caller_table(figures: list[CallerFigure]) -> str:
    lines = [
        "| record() call | calls | ns/event | median chunk ns/event | slowest chunk ns/event |",
        "|---|--:|--:|--:|--:|",
    ]
    for f in figures:
        chunks = [f"{ns:.0f}" if ns is not None else "-" for ns in (f.median_chunk_ns, f.max_chunk_ns)]
        lines.append(f"| {f.label} | {f.num_events:,} | {f.ns_per_event:.0f} | {' | '.join(chunks)} |")
    return "\n".join(lines)


def throughput_table(results: list[Throughput], raw_a: Throughput, raw_b: Throughput) -> str:
    lines = [
        "| case | events | record loop s | write s | events/s | vs raw (a) | vs raw (b) | "
        "caller CPU ns/event | writer process CPU ns/event |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        cpu = [f"{s / r.num_events * 1e9:.0f}" if s else "-" for s in (r.record_cpu_s, r.writer_cpu_s)]
        lines.append(
            f"| {r.label} | {r.num_events:,} | {r.record_s:.2f} | {r.write_s:.2f} | "
            f"{fmt_rate(r.events_per_s)} | {r.events_per_s / raw_a.events_per_s:.2f}x | "
            f"{r.events_per_s / raw_b.events_per_s:.2f}x | {' | '.join(cpu)} |"
        )
    return "\n".join(lines)


def verdict_lines(
    callers: list[CallerFigure], sustained: Throughput, writer: Throughput, raw: dict[str, Throughput]
) -> list[str]:
    ns = {f.key: f.ns_per_event for f in callers}
    best_raw = max(r.events_per_s for r in raw.values())
    rate_ok = sustained.events_per_s >= TARGET_EVENTS_PER_S
    loop_ns = ns["loop-alone"]
    caller_cpu_ns = sustained.record_cpu_s / sustained.num_events * 1e9 - loop_ns
    caller_ok = caller_cpu_ns <= TARGET_CALLER_NS
    writer_ns = sustained.writer_cpu_s / sustained.num_events * 1e9
    return [
        f"- **1M events/s: {'met' if rate_ok else 'not met'}.** Sustained "
        f"{fmt_rate(sustained.events_per_s)} events/s ({sustained.events_per_s / TARGET_EVENTS_PER_S:.0%} of the "
        f"target), from the first record() to close() returning; the writer process spends {writer_ns:.0f} ns "
        f"of CPU per event (unmarshal, pack, SQLite), so on its own core it takes up to "
        f"{fmt_rate(1e9 / writer_ns)} events/s. A flush of events already buffered runs at "
        f"{fmt_rate(writer.events_per_s)}. The row layout of schema 5 and before, one row per event, is bounded "
        f"by SQLite's executemany: {fmt_rate(raw['a'].events_per_s)} rows/s into its table on this machine, "
        f"{fmt_rate(best_raw)} rows/s with no index at all, before any Python-side conversion.",
        f"- **At most 0.5 µs per event on the caller's thread: {'met' if caller_ok else 'not met'}.** Recording "
        f"costs the sustained record loop's thread {caller_cpu_ns:.0f} ns of CPU per event, the record() call "
        f"and the hand-offs to the writer included: {caller_cpu_ns + loop_ns:.0f} ns with the recorder less "
        f"{loop_ns:.0f} ns for the loop's own work (the same loop without the call). Its wall time is "
        f"{ns['mixed-running']:.0f} ns per event: the loop outruns the writer, so back-pressure makes it wait; an "
        f"engine records far fewer events per second. Buffering alone, the writer paused: "
        f"{ns['mixed-paused']:.0f} ns per mixed event, {ns['alloc']:.0f} ns per alloc with 16 slots "
        f"({ns['alloc-nogc']:.0f} ns with the garbage collector disabled); the call alone (a no-op recorder) "
        f"{ns['floor']:.0f} ns.",
    ]


def section_body(
    callers: list[CallerFigure],
    throughputs: list[Throughput],
    raw: dict[str, Throughput],
    total_s: float,
    num_rounds: int,
) -> str:
    sustained, writer = throughputs[0], throughputs[1]
    num_events = sustained.num_events
    shares = ", ".join(f"{kind.value} {share:.0%}" for kind, share in KIND_SHARES.items())
    return "\n".join(
        [
            f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
            f"- command: `{command_line()}`",
            f"- machine: {machine('cpu')}",
            f"- SQLite {sqlite3.sqlite_version} (Python sqlite3), SQLAlchemy {sqlalchemy.__version__}; "
            f"{num_events:,} mixed events per throughput case, {num_rounds} alternating rounds of the recorder "
            f"cases (medians); whole run {total_s:.0f} s",
            "",
            "### Cost of record() on the caller's thread",
            "",
            caller_table(callers),
            "",
            "### Throughput into SQLite (level full)",
            "",
            throughput_table([*throughputs, *raw.values()], raw["a"], raw["b"]),
            "",
            "### Targets",
            "",
            *verdict_lines(callers, sustained, writer, raw),
            "",
            "Reading the tables:",
            "",
            "- The recorder buffers on the caller's thread (record() extends one flat list; no object per event) "
            "and hands the buffer to its writer process (marshal, sent through a socket pair, large batches in "
            "an anonymous in-memory file) when the step advances with the flush interval passed or "
            "`flush_max_events` buffered; the writer process unmarshals, packs the columns and writes them. The "
            "two share no interpreter lock; on this 2-core machine each can have a core.",
            "- Every case writes a fresh SQLite file (WAL, synchronous=NORMAL) in a temporary directory; "
            "after timing, its packed chunks (the raw cases: its events table) are checked for the event count, "
            "total slot bytes and total `num_tokens` of what was recorded.",
            "- `ns/event` is the total time over all calls, pauses of the garbage collector included; the "
            f"single-event rows also show the median and the slowest of {NUM_CHUNKS} equal chunks of the calls "
            "(a full collection lands in one chunk). Writer paused: `flush_interval_s` and `flush_max_events` "
            "too large to fire before `close()`, so the buffer only grows. The mixed rows are the record "
            "loops of the two throughput cases below: paused (writer only), and running with the defaults "
            "(0.2 s, 200,000 events), hand-offs and back-pressure waits included.",
            f"- Mixed events: {shares}; alloc/free carry 1-{MAX_SLOTS} slots (int64 numpy arrays), the rest "
            f"none; `recorder.step` advances every {EVENTS_PER_STEP} events.",
            "- `events/s` = events / (record loop + write): sustained counts from the first `record()` to "
            "`close()` returning with everything on disk; writer only times one `flush()` of events "
            "already buffered (the hand-off included); raw times `executemany` + commit of the rows the old "
            "writer would bind (slots already int32 bytes), so it has no Python-side conversion at all.",
            "- `caller CPU` is this process's CPU time in the record loop (hand-offs included, waits not); "
            "`writer process CPU` is the writer process's CPU time after its start (its imports, about 0.1 s, are "
            "left out as the recorder's construction is).",
            "- `vs raw` divides by the raw rate of the same events in the row layout that schema 6 replaced: "
            "(a) its schema as it was, (b) without its secondary indexes. Above 1.00x the packed recorder, "
            "Python conversion included, writes faster than SQLite alone could insert one row per event.",
        ]
    )


ABOUT = (
    "The recorder at level full: events per second into SQLite from the first record() to close(), "
    "and what recording costs the caller's thread per event."
)


def figures(
    callers: list[CallerFigure], sustained: Throughput, writer: Throughput, raw: dict[str, Throughput]
) -> list[Figure]:
    """RESULTS.md rows: the two targets, then the figures that explain them."""
    ns = {f.key: f.ns_per_event for f in callers}
    caller_cpu_ns = sustained.record_cpu_s / sustained.num_events * 1e9 - ns["loop-alone"]
    rate_ok = sustained.events_per_s >= TARGET_EVENTS_PER_S
    return [
        Figure(
            "sustained events/s into SQLite (record loop + close)",
            f"{fmt_rate(sustained.events_per_s)} events/s",
            f"≥ {fmt_rate(TARGET_EVENTS_PER_S)} events/s",
            "met" if rate_ok else "not met",
        ),
        Figure(
            "caller's thread CPU per event, sustained (loop's own work taken out)",
            f"{caller_cpu_ns:.0f} ns",
            f"≤ {TARGET_CALLER_NS:.0f} ns",
            "met" if caller_cpu_ns <= TARGET_CALLER_NS else "not met",
        ),
        Figure("record() per mixed event, writer paused (buffering alone)", f"{ns['mixed-paused']:.0f} ns"),
        Figure("record() call alone (a no-op recorder)", f"{ns['floor']:.0f} ns"),
        Figure(
            "writer process CPU per event, sustained",
            f"{sustained.writer_cpu_s / sustained.num_events * 1e9:.0f} ns",
        ),
        Figure("one flush() of buffered events (writer only)", f"{fmt_rate(writer.events_per_s)} events/s"),
        Figure(
            "raw sqlite3 executemany, one row per event (the layout before schema 6)",
            f"{fmt_rate(raw['a'].events_per_s)} rows/s",
        ),
    ]


def writer_ns(rounds: list[Throughput]) -> list[float]:
    return [r.writer_cpu_s / r.num_events * 1e9 for r in rounds]


def request_figures(sustained_rounds: list[Throughput], requests_rounds: list[Throughput]) -> list[Figure]:
    """What the requests' rows and sums add to the writer, per event: each round's pair, alternated."""
    without, with_ = writer_ns(sustained_rounds), writer_ns(requests_rounds)
    added = sorted(b - a for a, b in zip(without, with_, strict=True))
    pairs = ", ".join(f"{a:,.0f} / {b:,.0f}" for a, b in zip(without, with_, strict=True))
    return [
        Figure(
            f"writer process CPU per event, sustained, without / with {REQUESTS_PER_STEP} finished requests a step "
            "(their rows and request sums)",
            f"{statistics.median(without):,.0f} / {statistics.median(with_):,.0f} ns, medians of "
            f"{len(added)} alternating rounds ({pairs}); added per event: median {statistics.median(added):+,.0f} ns "
            f"(rounds {added[0]:+,.0f} to {added[-1]:+,.0f}), per request "
            f"{statistics.median(added) * EVENTS_PER_STEP / REQUESTS_PER_STEP / 1000:+,.1f} µs",
        )
    ]


def requests_line(sustained_rounds: list[Throughput], requests_rounds: list[Throughput]) -> str:
    (figure,) = request_figures(sustained_rounds, requests_rounds)
    return f"\n{figure.name}: {figure.value}"


# -- main --------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--events",
        type=int,
        default=None,
        help=f"events per throughput case (default {DEFAULT_NUM_EVENTS:,}; "
        f"--quick {QUICK_NUM_EVENTS:,}); caller cases use a tenth",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_NUM_EVENTS:,} events: about 25 s")
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help=f"alternating rounds of the sustained and writer-only cases (default {DEFAULT_ROUNDS})",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then cProfile the writer's packing of one buffer, in this process (stderr)",
    )
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="set its rows in the bench_recorder table of benchmarks/RESULTS.md",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.events = args.events or (QUICK_NUM_EVENTS if args.quick else DEFAULT_NUM_EVENTS)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.events < EVENTS_PER_STEP * NUM_CHUNKS * 10:
        parser.error(f"--events must be at least {EVENTS_PER_STEP * NUM_CHUNKS * 10}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start_s = time.perf_counter()

    def progress(what: str) -> None:
        print(f"  {what}: {time.perf_counter() - start_s:.1f} s", file=sys.stderr)

    callers = []
    for case in CALLER_CASES:
        callers.append(run_caller_case(case, args.events // 10))
        progress(case.label)
    steps = template_steps(args.seed)
    num_steps = args.events // EVENTS_PER_STEP
    expected = expected_of(steps, num_steps)
    requests = finished_requests(num_steps, args.seed)
    sustained_rounds: list[Throughput] = []
    requests_rounds: list[Throughput] = []
    writer_rounds: list[Throughput] = []
    for round_no in range(args.rounds):
        cases: list[tuple[str, Callable[[], Throughput], list[Throughput]]] = [
            ("sustained", lambda: run_sustained(steps, num_steps, expected), sustained_rounds),
            ("requests", lambda: run_sustained(steps, num_steps, expected, requests), requests_rounds),
            ("writer only", lambda: run_writer_only(steps, num_steps, expected), writer_rounds),
        ]
        for name, run_case, results in cases[round_no % 3 :] + cases[: round_no % 3]:
            results.append(run_case())
            progress(f"{name}, round {round_no + 1}")
    sustained, writer = median_throughput(sustained_rounds), median_throughput(writer_rounds)
    with_requests = median_throughput(requests_rounds)
    for key, label, record_s in (
        ("mixed-paused", "mixed events, writer paused (record loop of the writer-only case)", writer.record_s),
        ("mixed-running", "mixed events, writer running (record loop of the sustained case)", sustained.record_s),
        (
            "loop-alone",
            "the mixed loop's own work: no recorder, no call (CPU, best of 3)",
            loop_alone_s(steps, num_steps),
        ),
    ):
        callers.append(CallerFigure(key, label, expected.num_events, record_s / expected.num_events * 1e9, None, None))
    rows = raw_rows(steps, num_steps)
    raw = {}
    for variant in RAW_KINDS:
        raw[variant] = run_raw(variant, rows, expected)
        progress(f"raw ({variant})")
    del rows
    body = section_body(callers, [sustained, writer, with_requests], raw, time.perf_counter() - start_s, args.rounds)
    print(body)
    print(requests_line(sustained_rounds, requests_rounds))
    if args.write:
        versions = f"SQLite {sqlite3.sqlite_version}, SQLAlchemy {sqlalchemy.__version__}"
        found = figures(callers, sustained, writer, raw) + request_figures(sustained_rounds, requests_rounds)
        write_figures("bench_recorder", ABOUT, found, this_run(extra=versions))
    if args.profile:
        num_profile_steps = min(num_steps, PROFILE_NUM_EVENTS // EVENTS_PER_STEP)
        profile_writer(steps, num_profile_steps)


if __name__ == "__main__":
    main()
