"""SQLRecorder: events into an in-memory buffer, a background thread writes batches.

NOTE: levels
    off      nothing recorded (use NullRecorder)
    summary  usage samples, requests, leak checks, tree snapshots
    full     summary + every memory event with its slots (`enabled` is True only here)
The caller's thread pays one append per event (plus a length check), or one per batch
(record_batch); the writer drains the buffer every `flush_interval_s` or when
`flush_max_events` are waiting, packs the events into one chunk of columns (packed.py: a few
blobs, not a row per event) and inserts it with the other tables' rows, all in one
transaction. At 4 x flush_max_events waiting, record() waits for the writer (back-pressure).

NOTE: what survives
    SIGKILL        everything up to the last flush; the run stays 'running' (readers show
                   "ended without closing")
    a write fails  (a full disk, ...) recording stops: later records are dropped, one line on
                   stderr and in `failure` says through which step the capture is complete, and
                   close() marks the run 'incomplete' with that line (or, if even that write
                   fails, leaves it 'running'); everything committed before stays readable
    close()        flushes, marks the run (finished / interrupted / crashed / incomplete) and
                   folds the log into the file (store.settle); it never raises, and on the
                   main thread a second SIGINT/SIGTERM/SIGHUP while it runs is swallowed: the
                   capture always ends closed
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import numpy as np
from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError

from kvscope.telemetry import schema
from kvscope.telemetry.events import EventKind, PoolName, Recorder
from kvscope.telemetry.packed import BATCH, Chunk, Packer
from kvscope.telemetry.records import LEVELS, LeakCheck, NodeRow, RequestRecord, RunStatus, UsageSample
from kvscope.telemetry.store import BulkInsert, CaptureError, display_name, first_line, open_writer, settle

DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def slots_blob(slots: Any) -> bytes | None:
    """Slot indices as int32 little-endian bytes; accepts torch tensors without importing torch."""
    if slots is None:
        return None
    if type(slots).__module__.startswith("torch"):
        slots = slots.cpu().numpy()  # slot indices never need grad: no detach
    return slots.astype("<i4").tobytes() if isinstance(slots, np.ndarray) else np.asarray(slots, "<i4").tobytes()


def decode_slots(blob: bytes | None) -> list[int]:
    return [] if blob is None else np.frombuffer(blob, dtype="<i4").tolist()


class SQLRecorder(Recorder):
    def __init__(
        self,
        target: str | Path,
        *,
        level: str = "full",
        label: str = "",
        config: dict[str, Any] | None = None,
        flush_interval_s: float = 0.2,
        flush_max_events: int = 200_000,
    ) -> None:
        if level not in LEVELS[1:]:
            raise ValueError(f"recording level must be 'summary' or 'full' here, got {level!r}")
        self.engine = open_writer(target)
        self.name = display_name(target)
        self.level = level
        self.enabled = level == "full"
        self.summary_enabled = True
        self.step = 0
        self.error: BaseException | None = None  # the write that failed
        self.failure: str | None = None  # "capture complete through step N: <reason>" once recording stopped
        self._complete_step = -1  # NOTE: every row of steps <= this is committed
        self._snapshot_step: int | None = None
        self.closed = False
        self._packer = Packer()
        self._chunks = 0
        self._events: deque[tuple[Any, ...]] = deque()
        self._rows: deque[tuple[str, tuple[Any, ...]]] = deque()
        self._max_events = flush_max_events
        self._backlog_cap = 4 * flush_max_events
        self._interval_s = flush_interval_s
        self._inserts = {
            "event_chunks": BulkInsert(self.engine, schema.event_chunks, [c.name for c in schema.event_chunks.c]),
            "event_columns": BulkInsert(self.engine, schema.event_columns, [c.name for c in schema.event_columns.c]),
            "event_strings": BulkInsert(self.engine, schema.event_strings, [c.name for c in schema.event_strings.c]),
            "tree_snapshots": BulkInsert(self.engine, schema.tree_snapshots, schema.TREE_SNAPSHOT_COLUMNS),
            "leak_checks": BulkInsert(self.engine, schema.leak_checks, schema.LEAK_CHECK_COLUMNS),
            "usage": BulkInsert(self.engine, schema.usage, schema.USAGE_COLUMNS),
            "requests": BulkInsert(self.engine, schema.requests, schema.REQUEST_COLUMNS),
        }
        try:
            self.run_id = self._start_run(label, config or {})
        except SQLAlchemyError as err:
            self.engine.dispose()
            raise CaptureError(f"{self.name}: cannot start a run ({first_line(err)})") from err
        self._flush_lock = threading.Lock()
        self._flush_waiters: deque[threading.Event] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvscope-recorder", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _start_run(self, label: str, config: dict[str, Any]) -> int:
        now = time.time()
        # NOTE: the clock anchor: a t_mono of this run is wall time wall_s + (t_mono - mono_s)
        config = {**config, "clock": {"wall_s": now, "mono_s": time.monotonic()}}
        with self.engine.begin() as conn:
            result = conn.execute(schema.runs.insert().values(
                label=label, status=RunStatus.RUNNING, started_at=now, heartbeat_at=now, host=socket.gethostname(),
                pid=os.getpid(), level=self.level, config=json.dumps(config, default=str, sort_keys=True),
            ))
            assert result.inserted_primary_key is not None
            return int(result.inserted_primary_key[0])

    # -- the caller's side -----------------------------------------------------------------

    def record(
        self,
        kind: EventKind,
        *,
        pool: PoolName | None = None,
        rid: str | None = None,
        node_id: int | None = None,
        num_tokens: int = 0,
        slots: Any = None,
        reason: StrEnum | None = None,
        aux: int = 0,
        principal: str | None = None,
    ) -> None:
        # NOTE: a buffered event is packed.BUFFER_FIELDS (its seq is its place in the buffer);
        # plain str values, not Enum members, so the GC can stop tracking buffered tuples
        events = self._events
        events.append((self.step, time.monotonic(), kind._value_, pool and pool._value_, rid, node_id, num_tokens,
                       aux, reason and reason._value_, principal, slots))
        if len(events) >= self._max_events:
            self._wake.set()
            if len(events) >= self._backlog_cap:
                self.flush()  # back-pressure: never let the buffer outgrow the writer without bound

    def record_batch(self, kind: EventKind, *, pool: PoolName | None, rids: Any, num_tokens: Any,
                     slots: Any) -> None:
        events = self._events
        events.append((self.step, time.monotonic(), kind._value_, pool and pool._value_, tuple(rids), BATCH,
                       tuple(num_tokens), 0, None, None, slots))
        if len(events) >= self._max_events:
            self._wake.set()
            if len(events) >= self._backlog_cap:
                self.flush()  # back-pressure, as record()

    def usage(self, sample: UsageSample) -> None:
        swa = sample.swa or (None, None, None, None)
        host = (*sample.host, sample.cum_host_hit_tokens, sample.cum_written_tokens, sample.cum_loaded_tokens) \
            if sample.host is not None else (None,) * 7
        used = sample.full_used
        if used is None and sample.full.available is not None and sample.full.evictable is not None:
            used = sample.full.used
        self._rows.append(("usage", (self.run_id, sample.step, time.monotonic(), *sample.full, *swa,
                                     *sample[3:13], *host, used)))

    def leak_check(self, check: LeakCheck) -> None:
        self._rows.append(("leak_checks", (self.run_id, check.step, check.pool, time.monotonic(), *check[2:8],
                                           check.ok, None if check.ok else check.message())))

    def request(self, rec: RequestRecord) -> None:
        """Store a request's final record (call once, when it ends or when the run closes)."""
        moments = schema.REQUEST_MOMENTS
        self._rows.append(("requests", (
            self.run_id, rec.rid, rec.principal, rec.status, rec.prompt_len, rec.cached_tokens, rec.output_len,
            rec.num_retractions, *(rec.times.get(m) for m in moments), *(rec.steps.get(m) for m in moments),
        )))

    def tree_snapshot(self, step: int, rows: list[Any]) -> None:
        """`rows`: the cache's export_nodes() (NodeRow tuples; a plain tuple without the fields
        added later gets NodeRow's defaults). One snapshot per step: a second at the same step
        (the engine's end-of-run snapshot on a snapshot step) is not stored."""
        if step == self._snapshot_step:
            return
        self._snapshot_step = step
        # NOTE: a list, not a generator: deque.extend of a list runs no Python code, so the writer
        # never drains half a snapshot; a snapshot lands in one transaction (readers memoize them)
        self._rows.extend([("tree_snapshots", (self.run_id, step, *NodeRow(*row))) for row in rows])

    # -- the writer's side -----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            waiters = [self._flush_waiters.popleft() for _ in range(len(self._flush_waiters))]
            self._flush_now()
            for waiter in waiters:
                waiter.set()
            if self._stop:
                return

    def flush(self) -> None:
        """Block until everything recorded so far is on disk.

        The writing happens on the writer thread, so a signal that interrupts the caller
        (SIGINT, SIGTERM) can never interrupt a write transaction halfway.
        """
        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            self._flush_now()
            return
        done = threading.Event()
        self._flush_waiters.append(done)
        self._wake.set()
        done.wait()

    def _flush_now(self, *, closing: bool = False) -> None:
        """Write everything buffered so far, in one transaction; once a write has failed,
        drop it (recording stopped)."""
        with self._flush_lock:
            if self.failure is not None:
                self._events.clear()
                self._rows.clear()
                return
            step = self.step
            try:
                self._write(self._drain())
            except Exception as err:  # the writer thread must not die silently
                self._stop_recording(err)
                return
            self._complete_step = step if closing else step - 1  # NOTE: rows of `step` may still arrive

    def _stop_recording(self, err: BaseException) -> None:
        """Recording stops: one line on stderr and in `failure`, through which step the capture
        is complete."""
        self.error = err
        reason = first_line(err)
        done = self._complete_step
        self.failure = (f"capture complete through step {done}: {reason}" if done >= 0
                        else f"capture holds no complete step: {reason}")
        print(f"kvscope recorder: recording stopped, {self.failure}", file=sys.stderr, flush=True)

    def _drain(self) -> dict[str, list[tuple[Any, ...]]]:
        out: dict[str, list[tuple[Any, ...]]] = {name: [] for name in self._inserts}
        events, rows = self._events, self._rows
        buffered = [events.popleft() for _ in range(len(events))]
        if buffered:
            self._add_chunk(out, self._packer.pack(buffered))
        for _ in range(len(rows)):
            table, row = rows.popleft()
            out[table].append(row)
        return out

    def _add_chunk(self, out: dict[str, list[tuple[Any, ...]]], chunk: Chunk) -> None:
        run_id, number = self.run_id, self._chunks
        self._chunks += 1
        out["event_strings"].extend((run_id, code, text) for code, text in chunk.new_strings)
        out["event_chunks"].append((run_id, number, chunk.first_seq, chunk.num_events, chunk.first_step,
                                    chunk.last_step, chunk.kinds))
        out["event_columns"].extend((run_id, number, name, data) for name, data in chunk.columns.items())

    def _write(self, batches: dict[str, list[tuple[Any, ...]]]) -> None:
        with self.engine.begin() as conn:
            for table, rows in batches.items():
                if rows:
                    insert = self._inserts[table]
                    conn.exec_driver_sql(insert.sql, insert.params(rows))
            conn.execute(update(schema.runs).where(schema.runs.c.id == self.run_id).values(heartbeat_at=time.time()))

    # -- closing ---------------------------------------------------------------------------

    def close(self, status: str = RunStatus.FINISHED, error: str | None = None) -> None:
        """Flush everything and mark the run ended (`status`, or 'incomplete' once a write has
        failed, whatever `status` says). Idempotent; never raises."""
        if self.closed:
            return
        self.closed = True
        with _signals_deferred():
            self._stop = True
            self._wake.set()
            self._thread.join()
            self._flush_now(closing=True)
            self._mark_ended(status, error)
            settle(self.engine)
            self.engine.dispose()
            atexit.unregister(self.close)

    def _mark_ended(self, status: str, error: str | None) -> None:
        if self.failure is not None:
            status, error = RunStatus.INCOMPLETE, self.failure if error is None else f"{self.failure}; {error}"
        try:
            with self.engine.begin() as conn:
                conn.execute(update(schema.runs).where(schema.runs.c.id == self.run_id).values(
                    status=status, ended_at=time.time(), heartbeat_at=time.time(), error=error))
        except Exception as err:  # NOTE: the run stays 'running': readers show "ended without closing"
            if self.failure is None:
                self._stop_recording(err)

    def __enter__(self) -> SQLRecorder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close(RunStatus.FINISHED)
        elif issubclass(exc_type, KeyboardInterrupt | SystemExit):
            self.close(RunStatus.INTERRUPTED)
        else:
            self.close(RunStatus.CRASHED, f"{exc_type.__name__}: {exc}")


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """On the main thread, SIGINT/SIGTERM/SIGHUP arriving inside the block are swallowed (the
    block is closing the capture the signal asks to close); elsewhere signals stay as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _swallow) for sig in DEFERRED_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def _swallow(_signum: int, _frame: FrameType | None) -> None:
    pass


def install_signal_handlers() -> None:
    """SIGTERM exits like SIGINT does (through exceptions), so `with recorder:` closes it."""

    def _terminate(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _terminate)
