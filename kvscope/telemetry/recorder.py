"""SQLRecorder: the recording process buffers, a writer process packs and writes.

NOTE: levels
    off      nothing recorded (use NullRecorder)
    summary  usage samples, requests, leak checks, tree snapshots
    full     summary + every memory event with its slots (`enabled` is True only here)

NOTE: the two processes
    recording process  record() extends one flat list with the event's values (packed.ITEM_FIELDS:
                       no object per event, nothing for the garbage collector to track) and does
                       nothing else; the other records append rows. When the step advances with
                       `flush_interval_s` passed or `flush_max_events` buffered, at idle points and
                       on flush(), the buffer is handed to the writer: slots that are not int64
                       numpy arrays (torch tensors on any device, lists) are converted in one go,
                       then the buffer is marshalled and sent (channel.py). Callers are one thread.
    writer process     kvscope.telemetry.writer: packs, writes, acknowledges, and beats the run's
                       heartbeat every `heartbeat_interval_s` while this process lives (idle or not).
                       Its CPU time and its interpreter are its own.
With more than 4 x flush_max_events handed over and not yet written, a hand-off waits for the
writer (back-pressure). flush() waits until everything recorded so far is on disk.
NOTE: a stalled writer (stopped, hung) never blocks the recording process for good: a wait for
it, or a send it does not take, gives up after WRITER_PATIENCE_S without a word from it (after a
stop signal, INTERRUPTED_PATIENCE_S: Ctrl-C ends a run within seconds); the writer is then ended
(SIGKILL: it is our child, and what it committed stays) and recording stops as below.

NOTE: what survives
    SIGKILL        of the recording process: everything handed to the writer (which writes it,
                   then exits); the run stays 'running' (readers show "ended without closing")
    a write fails  (a full disk, ...) recording stops: later records are dropped, one line on
                   stderr and in `failure` says through which step the capture is complete, and
                   close() marks the run 'incomplete' with that line (folding the log into the
                   file first when the log has no room left for it; if even that fails, it
                   leaves it 'running'); everything committed before stays readable. The
                   writer process ending unexpectedly, or stalling, stops recording the same way.
    close()        hands over the rest, waits for the writer to write it and exit, marks the run
                   (finished / interrupted / crashed / incomplete) and folds the log into the file
                   (store.settle); it never raises, and on the main thread a second
                   SIGINT/SIGTERM/SIGHUP while it runs is swallowed: the capture always ends closed
    process exit   without close() (an error ended the owner first): the exit-time close marks
                   the run 'crashed' ("the process exited without closing its run"), never
                   'finished'; when an exception, Ctrl-C or sys.exit(N) ended it, as exits.py
                   says (crashed with the exception's line, interrupted, "exited with code N")
"""

from __future__ import annotations

import atexit
import json
import marshal
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum, StrEnum
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import numpy as np
from sqlalchemy import bindparam, case, delete, literal_column, select, update
from sqlalchemy.exc import SQLAlchemyError

import kvscope
from kvscope.telemetry import request_sums, schema
from kvscope.telemetry.channel import Channel, ChannelClosed, Message
from kvscope.telemetry.events import EventKind, PoolName, Recorder
from kvscope.telemetry.exits import exit_status
from kvscope.telemetry.packed import BATCH, ITEM_FIELDS, ITEM_WIDTH
from kvscope.telemetry.records import (
    LEVELS,
    CensusBlock,
    LeakCheck,
    NodeRow,
    RequestRecord,
    Routing,
    RunStatus,
    UsageSample,
)
from kvscope.telemetry.retention import USAGE_EVERY_STEPS, Retention
from kvscope.telemetry.store import (
    CaptureError,
    add_statement,
    compiled_statement,
    display_name,
    file_of,
    first_line,
    insert_statement,
    open_writer,
    server_url,
    settle,
    upsert_statement,
)
from kvscope.telemetry.writer import HEARTBEAT_INTERVAL_S, RetentionStatements, Statement, WriterSettings

DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
SLOTS_AT = ITEM_FIELDS.index("slots")
# NOTE: the writer does no linear algebra: without these numpy's BLAS starts a thread per core,
# which costs the writer about 60 ms of CPU at every start
WRITER_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
BACKLOG_FLUSHES = 4  # NOTE: flush_max_events x this, handed over and not yet written, makes a hand-off wait
WRITER_PATIENCE_S = 60.0  # NOTE: a writer that says nothing this long while we wait is stalled
INTERRUPTED_PATIENCE_S = 5.0  # the same while a run stopped by a signal closes
WRITER_EXIT_S = 5.0  # NOTE: a writer whose end of the channel closed has this long to exit
_NDARRAY = np.ndarray
_INT64 = np.dtype(np.int64)
_monotonic = time.monotonic


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
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        retention: Retention | None = None,
    ) -> None:
        if level not in LEVELS[1:]:
            raise ValueError(f"recording level must be 'summary' or 'full' here, got {level!r}")
        self.engine = open_writer(target)
        self.name = display_name(target)
        self.level = level
        self.enabled = level == "full"
        self.summary_enabled = True
        self._step = 0
        self.failure: str | None = None  # "capture complete through step N: <reason>" once recording stopped
        self._complete_step = -1  # NOTE: every row of steps <= this is committed (the writer says)
        self._snapshot_step: int | None = None
        self.closed = False
        self._announce = True  # NOTE: off while a run stopped by a signal closes: its one line is the verb's
        self._pid = os.getpid()
        # NOTE: the buffer: flat items (packed.ITEM_FIELDS), rows as (table, row); slots to convert
        # before a hand-off as (position in _items, slots)
        self._items: list[Any] = []
        self._extend = self._items.extend
        self._rows: list[tuple[str, tuple[Any, ...]]] = []
        self._deferred: list[tuple[int, Any]] = []
        self._has_batches = False
        self._max_items = flush_max_events * ITEM_WIDTH
        self._backlog_events = BACKLOG_FLUSHES * flush_max_events
        self._interval_s = flush_interval_s
        self._due_s = _monotonic() + flush_interval_s
        self._num_sent = self._num_acked = 0  # batches
        self._items_sent = self._items_done = self._rows_sent = 0
        self._writer_closed = False
        self._writer_ready = False
        self._heartbeat_interval_s = heartbeat_interval_s
        self.retention = retention if retention is not None and retention.bounded else None
        try:
            self.run_id = self._start_run(label, config or {})
        except SQLAlchemyError as err:
            self.engine.dispose()
            raise CaptureError(f"{self.name}: cannot start a run ({first_line(err)})") from err
        self._channel, self._process = _start_writer(self._writer_settings(target))
        self._channel.send_timeout_s = WRITER_PATIENCE_S
        atexit.register(self._close_at_exit)

    def _start_run(self, label: str, config: dict[str, Any]) -> int:
        now = time.time()
        # NOTE: the clock anchor: a t_mono of this run is wall time wall_s + (t_mono - mono_s)
        config = {**config, "clock": {"wall_s": now, "mono_s": time.monotonic()}}
        with self.engine.begin() as conn:
            result = conn.execute(
                schema.runs.insert().values(
                    label=label,
                    status=RunStatus.RUNNING,
                    started_at=now,
                    heartbeat_at=now,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    level=self.level,
                    config=json.dumps(config, default=str, sort_keys=True),
                    request_sums=True,  # NOTE: its writer sums every request row it writes (request_sums.py)
                )
            )
            assert result.inserted_primary_key is not None
            return int(result.inserted_primary_key[0])

    def _writer_settings(self, target: str | Path) -> WriterSettings:
        engine, path = self.engine, file_of(target)
        tables = {
            "event_strings": (schema.event_strings, [c.name for c in schema.event_strings.c]),
            "event_chunks": (schema.event_chunks, [c.name for c in schema.event_chunks.c]),
            "event_columns": (schema.event_columns, [c.name for c in schema.event_columns.c]),
            "tree_snapshots": (schema.tree_snapshots, schema.TREE_SNAPSHOT_COLUMNS),
            "usage": (schema.usage, schema.USAGE_COLUMNS),
            "requests": (schema.requests, schema.REQUEST_COLUMNS),
        }
        # NOTE: two censuses in one step (a live poll, the idle census) repeat a key: the first row stays,
        # a failing leak check replaces a passing one (schema's version notes, 8)
        kept = {
            "leak_checks": upsert_statement(
                engine,
                schema.leak_checks,
                schema.LEAK_CHECK_COLUMNS,
                schema.LEAK_CHECK_KEY,
                lambda stored, new: stored.ok & ~new.ok,
            ),
            "census_blocks": upsert_statement(
                engine, schema.census_blocks, schema.CENSUS_BLOCK_COLUMNS, schema.CENSUS_BLOCK_KEY
            ),
        }
        kept |= request_sum_statements(engine)
        kept["run_summaries"] = run_summary_statement(engine)
        heartbeat = (
            update(schema.runs)
            .where(schema.runs.c.id == bindparam("run_id"))
            .values(heartbeat_at=bindparam("heartbeat_at"))
        )
        return WriterSettings(
            file=None if path is None else str(path),
            url=None if path is not None else server_url(str(target)).render_as_string(hide_password=False),
            run_id=self.run_id,
            inserts={name: insert_statement(engine, table, columns) for name, (table, columns) in tables.items()}
            | kept,
            heartbeat=compiled_statement(engine, heartbeat, ("heartbeat_at", "run_id")),
            heartbeat_interval_s=self._heartbeat_interval_s,
            retention=self.retention,
            retention_statements=None if self.retention is None else _retention_statements(engine),
        )

    @property
    def writer_pid(self) -> int:
        return self._process.pid

    def wait_ready(self) -> None:
        """Block until the writer process has started (its imports take about 0.1 s of CPU, on
        another core where there is one); a benchmark waits so as not to time them."""
        while not self._writer_ready and not self._writer_closed:
            self._wait_for_writer()

    # -- the caller's side -----------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        self.poll()

    def poll(self) -> None:
        """Hand the buffer to the writer when `flush_interval_s` has passed since the last
        hand-off or `flush_max_events` are buffered (setting `step` does this)."""
        if len(self._items) >= self._max_items or _monotonic() >= self._due_s:
            self._hand_off()

    def idle(self) -> None:
        if self._items or self._rows:
            self._hand_off()

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
        # NOTE: plain str values, not Enum members (marshal carries only plain values); slots other
        # than int64 arrays are converted at the hand-off, all at once (one copy off a GPU)
        if slots is not None and (slots.__class__ is not _NDARRAY or slots.dtype is not _INT64):
            self._deferred.append((len(self._items) + SLOTS_AT, slots))
        self._extend(
            (
                self._step,
                _monotonic(),
                kind._value_,
                pool and pool._value_,
                rid,
                node_id,
                num_tokens,
                aux,
                reason and reason._value_,
                principal,
                slots,
            )
        )

    def extend_items(self, items: list[Any]) -> None:
        """Events another process buffered in the same flat layout (packed.ITEM_FIELDS, plain
        values, slots as lists or int64 arrays): kvscope.telemetry.remote's host hands them on."""
        start = len(self._items)
        for i in range(SLOTS_AT, len(items), ITEM_WIDTH):
            if items[i] is not None:
                self._deferred.append((start + i, items[i]))
        self._extend(items)

    def record_batch(self, kind: EventKind, *, pool: PoolName | None, rids: Any, num_tokens: Any, slots: Any) -> None:
        if slots is not None and (slots.__class__ is not _NDARRAY or slots.dtype is not _INT64):
            self._deferred.append((len(self._items) + SLOTS_AT, slots))
        self._has_batches = True
        self._extend(
            (
                self._step,
                _monotonic(),
                kind._value_,
                pool and pool._value_,
                tuple(rids),
                BATCH,
                tuple(num_tokens),
                0,
                None,
                None,
                slots,
            )
        )

    def usage(self, sample: UsageSample) -> None:
        swa = sample.swa or (None, None, None, None)
        host = (
            (*sample.host, sample.cum_host_hit_tokens, sample.cum_written_tokens, sample.cum_loaded_tokens)
            if sample.host is not None
            else (None,) * 7
        )
        used = sample.full_used
        if used is None and sample.full.available is not None and sample.full.evictable is not None:
            used = sample.full.used
        self._rows.append(
            ("usage", (self.run_id, sample.step, time.monotonic(), *sample.full, *swa, *sample[3:13], *host, used))
        )

    def leak_check(self, check: LeakCheck) -> None:
        self._rows.append(
            (
                "leak_checks",
                (
                    self.run_id,
                    check.step,
                    check.pool,
                    time.monotonic(),
                    *check[2:8],
                    check.ok,
                    None if check.ok else check.message(),
                    check.census,
                ),
            )
        )

    def census_blocks(self, blocks: list[CensusBlock]) -> None:
        run_id = self.run_id
        self._rows.extend([("census_blocks", (run_id, *block.row())) for block in blocks])

    def request(self, rec: RequestRecord) -> None:
        """Store a request's final record (call once, when it ends or when the run closes)."""
        moments = schema.REQUEST_MOMENTS
        self._rows.append(
            (
                "requests",
                (
                    self.run_id,
                    rec.rid,
                    rec.principal,
                    str(rec.status),
                    rec.prompt_len,
                    rec.cached_tokens,
                    rec.output_len,
                    rec.num_retractions,
                    *(rec.times.get(m) for m in moments),
                    *(rec.steps.get(m) for m in moments),
                    *_routing_fields(rec.routing),
                ),
            )
        )

    def tree_snapshot(self, step: int, rows: list[Any]) -> None:
        """`rows`: the cache's export_nodes() (NodeRow tuples; a plain tuple without the fields
        added later gets NodeRow's defaults). One snapshot per step: a second at the same step
        (the engine's end-of-run snapshot on a snapshot step) is not stored."""
        if step == self._snapshot_step:
            return
        self._snapshot_step = step
        run_id, width = self.run_id, len(NodeRow._fields)
        self._rows.extend(
            [("tree_snapshots", (run_id, step, *(row if len(row) == width else NodeRow(*row)))) for row in rows]
        )

    # -- handing over ----------------------------------------------------------------------

    def flush(self) -> None:
        """Block until everything recorded so far is on disk (or dropped, once recording stopped)."""
        self._hand_off()
        while self._num_acked < self._num_sent and not self._writer_closed:
            self._wait_for_writer()

    def _hand_off(self, *, closing: bool = False, patience_s: float = WRITER_PATIENCE_S) -> None:
        """Send the buffer to the writer as one batch. NOTE: the buffer is forgotten only after
        the send: a signal in between sends it again, and the writer skips what it has."""
        self._due_s = _monotonic() + self._interval_s
        self._read_answers()
        items, rows = self._items, self._rows
        if self.failure is not None or self._writer_closed:
            items.clear()
            rows.clear()
            self._deferred.clear()
            return
        if not items and not rows and not closing:
            return
        try:
            body = self._body()
        except (ValueError, TypeError) as err:
            self._stop_recording(f"a record could not be handed to the writer ({err})")
            return
        num_items = len(items) // ITEM_WIDTH
        header = ("batch", self._num_sent, self._items_sent, self._rows_sent, self._step, closing, self._has_batches)
        try:
            self._channel.send(header, body)
        except ChannelClosed:
            self._writer_gone()
            return
        self._num_sent += 1
        self._items_sent += num_items
        self._rows_sent += len(rows)
        items.clear()
        rows.clear()
        self._has_batches = False
        while self._items_sent - self._items_done > self._backlog_events and not self._writer_closed:
            self._wait_for_writer(patience_s)  # back-pressure

    def _body(self) -> bytes:
        """marshal of (items, rows), their slots int64 arrays (raw bytes on the wire)."""
        items, rows = self._items, self._rows
        if self._deferred:
            _convert_slots(items, self._deferred)
            self._deferred.clear()
        try:
            return marshal.dumps((items, rows))
        except ValueError:  # NOTE: a non-contiguous array, a numpy scalar, an Enum member: the slow way
            for i in range(SLOTS_AT, len(items), ITEM_WIDTH):
                if items[i] is not None:
                    items[i] = np.ascontiguousarray(items[i], np.int64).reshape(-1)
            items[:] = [v if i % ITEM_WIDTH == SLOTS_AT else _plain(v) for i, v in enumerate(items)]
            rows[:] = [(table, tuple(_plain(v) for v in row)) for table, row in rows]
            return marshal.dumps((items, rows))

    def _read_answers(self) -> None:
        if self._writer_closed:
            return
        try:
            answers = self._channel.poll()
        except ChannelClosed:
            self._writer_gone()
            return
        for answer in answers:
            self._take(answer)

    def _wait_for_writer(self, patience_s: float = WRITER_PATIENCE_S) -> None:
        """Take the writer's next answer; a writer silent for `patience_s` is stalled."""
        try:
            answer = self._channel.receive(patience_s)
        except ChannelClosed:
            self._writer_gone()
            return
        if answer is None:
            self._writer_stalled(patience_s)
        else:
            self._take(answer)

    def _take(self, answer: Message) -> None:
        header = answer.header
        if answer.kind == "ack":
            self._num_acked, self._items_done, self._complete_step = header[1] + 1, header[2], header[3]
        elif answer.kind == "failed":
            self._stop_recording(str(header[1]))
        elif answer.kind == "closed":
            self._complete_step = header[1]
            self._writer_closed = True
        elif answer.kind == "ready":
            self._writer_ready = True

    def _writer_gone(self) -> None:
        """The writer's end of the channel closed before it said "closed": it died (or a send
        it did not take timed out: it stalled)."""
        self._writer_closed = True
        self._num_acked = self._num_sent
        if self.failure is None:
            try:
                code = self._process.wait(WRITER_EXIT_S)
            except subprocess.TimeoutExpired:
                self._writer_stalled(self._channel.send_timeout_s or WRITER_EXIT_S)
                return
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            self._stop_recording(f"the recorder's writer process ended ({how})")

    def _writer_stalled(self, silent_s: float) -> None:
        """The writer said nothing for `silent_s` while we waited (stopped, hung): end it (what
        it committed stays) and stop recording."""
        self._writer_closed = True
        self._num_acked = self._num_sent
        if self._process.poll() is None:
            self._process.kill()  # NOTE: SIGKILL ends a stopped process too
            self._process.wait()
        if self.failure is None:
            self._stop_recording(
                f"the recorder's writer process answered nothing for {silent_s:g} s (stopped or hung) and was ended"
            )

    def _stop_recording(self, reason: str) -> None:
        """Recording stops: one line on stderr and in `failure`, through which step the capture
        is complete."""
        done = self._complete_step
        self.failure = (
            f"capture complete through step {done}: {reason}"
            if done >= 0
            else f"capture holds no complete step: {reason}"
        )
        if self._announce:
            print(f"kvscope recorder: recording stopped, {self.failure}", file=sys.stderr, flush=True)

    # -- closing ---------------------------------------------------------------------------

    def close(self, status: str = RunStatus.FINISHED, error: str | None = None) -> None:
        """Hand over the rest, let the writer write it and exit, and mark the run ended
        (`status`, or 'incomplete' once recording stopped, whatever `status` says). Idempotent;
        never raises; does nothing in a forked child (the run is its parent's)."""
        if self.closed or os.getpid() != self._pid:
            return
        self.closed = True
        interrupted = status == RunStatus.INTERRUPTED
        patience_s = INTERRUPTED_PATIENCE_S if interrupted else WRITER_PATIENCE_S
        self._announce = not interrupted  # NOTE: a failure still marks the run, in runs.error
        with _signals_deferred():
            self._channel.send_timeout_s = patience_s
            self._hand_off(closing=True, patience_s=patience_s)
            if not self._writer_closed:
                try:
                    self._channel.send(("close",))
                except ChannelClosed:
                    self._writer_gone()
                while not self._writer_closed:
                    self._wait_for_writer(patience_s)
            self._process.wait()
            self._channel.close()
            self._mark_ended(status, error)
            settle(self.engine)
            self.engine.dispose()
            atexit.unregister(self._close_at_exit)

    def _close_at_exit(self) -> None:
        """The process exits and its owner never closed the run (an error ended it before): the
        run did not finish (an exception's line when one ended it, exits.py)."""
        ending = exit_status()
        if ending.status == RunStatus.FINISHED:
            self.close(RunStatus.CRASHED, "the process exited without closing its run")
        else:
            self.close(*ending)

    def _mark_ended(self, status: str, error: str | None) -> None:
        """NOTE: a write that failed for room (a full disk, a file-size limit) may leave the log too
        full for even this one page: the log is then folded into the file (settle: the rows it
        holds are kept, the log file goes) and the end written once more."""
        if self.failure is not None:
            status, error = RunStatus.INCOMPLETE, self.failure if error is None else f"{self.failure}; {error}"
        mark = (
            update(schema.runs)
            .where(schema.runs.c.id == self.run_id)
            .values(status=status, ended_at=time.time(), heartbeat_at=time.time(), error=error)
        )
        for last_try in (False, True):
            try:
                with self.engine.begin() as conn:
                    conn.execute(mark)
                return
            except Exception as err:  # NOTE: the run stays 'running': readers show "ended without closing"
                if not last_try and settle(self.engine):
                    continue
                if self.failure is None:
                    self._stop_recording(first_line(err))
                return

    def __enter__(self) -> SQLRecorder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close(RunStatus.FINISHED)
        elif issubclass(exc_type, KeyboardInterrupt | SystemExit):
            self.close(RunStatus.INTERRUPTED)
        else:
            self.close(RunStatus.CRASHED, f"{exc_type.__name__}: {exc}")


def request_sum_statements(engine: Any) -> dict[str, Statement]:
    """The upserts that add a batch's request sums (request_sums.sums_rows) to those stored, by table."""

    def added(names: tuple[str, ...]) -> Any:
        return lambda stored, new: {n: stored[n] + new[n] for n in names}

    def widened(stored: Any, new: Any) -> dict[str, Any]:
        return {
            "num_requests": stored.num_requests + new.num_requests,
            "min_ms": case((new.min_ms < stored.min_ms, new.min_ms), else_=stored.min_ms),
            "max_ms": case((new.max_ms > stored.max_ms, new.max_ms), else_=stored.max_ms),
        }

    sums, latencies = request_sums.SUM_COLUMNS, request_sums.LATENCY_COLUMNS
    return {
        "request_sums": add_statement(
            engine, schema.request_sums, sums, request_sums.SUM_KEY, added(sums[len(request_sums.SUM_KEY) :])
        ),
        "request_latencies": add_statement(
            engine, schema.request_latencies, latencies, request_sums.LATENCY_KEY, widened
        ),
    }


def run_summary_statement(engine: Any) -> Statement:
    """The upsert that stores a run's folded summaries (packed.SummaryFold.row), replacing those stored."""
    key = ("run_id",)
    rest = [n for n in schema.RUN_SUMMARY_COLUMNS if n not in key]
    return add_statement(
        engine, schema.run_summaries, schema.RUN_SUMMARY_COLUMNS, key, lambda _stored, new: {n: new[n] for n in rest}
    )


def _retention_statements(engine: Any) -> RetentionStatements:
    r, k, c, x = schema.event_retention, schema.event_columns, schema.event_chunks, schema.ledger_checkpoints
    t, checks, u, strings = schema.tree_snapshots, schema.leak_checks, schema.usage, schema.event_strings
    moved = ("first_seq", "first_step", "dropped_chunks", "dropped_bytes", "dropped_at")
    update_row = update(r).where(r.c.run_id == bindparam("run_id")).values({n: bindparam(n) for n in moved})
    return RetentionStatements(
        insert=insert_statement(engine, r, [col.name for col in r.c]),
        update=compiled_statement(engine, update_row, (*moved, "run_id")),
        delete_columns=compiled_statement(
            engine,
            delete(k).where(k.c.run_id == bindparam("run_id"), k.c.chunk <= bindparam("chunk")),
            ("run_id", "chunk"),
        ),
        delete_chunks=compiled_statement(
            engine,
            delete(c).where(c.c.run_id == bindparam("run_id"), c.c.chunk <= bindparam("chunk")),
            ("run_id", "chunk"),
        ),
        checkpoint=compiled_statement(
            engine, select(x.c.through_seq).where(x.c.run_id == bindparam("run_id")), ("run_id",)
        ),
        delete_snapshots=compiled_statement(
            engine,
            delete(t).where(
                t.c.run_id == bindparam("run_id"),
                t.c.step < bindparam("first_step"),
                t.c.step.not_in(select(checks.c.step).where(checks.c.run_id == bindparam("run_id"))),
            ),
            ("run_id", "first_step"),
        ),
        thin_usage=compiled_statement(
            engine,
            delete(u).where(
                u.c.run_id == bindparam("run_id"),
                u.c.step >= bindparam("from_step"),
                u.c.step < bindparam("first_step"),
                u.c.step % literal_column(str(USAGE_EVERY_STEPS)) != literal_column("0"),  # NOTE: no bound literals
                u.c.step.not_in(select(checks.c.step).where(checks.c.run_id == bindparam("run_id"))),
            ),
            ("run_id", "from_step", "first_step"),
        ),
        delete_strings=compiled_statement(
            engine,
            delete(strings).where(strings.c.run_id == bindparam("run_id"), strings.c.code == bindparam("code")),
            ("run_id", "code"),
        ),
    )


def _start_writer(settings: WriterSettings) -> tuple[Channel, subprocess.Popen[bytes]]:
    """The writer process (in a process group of its own: a terminal's Ctrl-C goes to the
    recording process, which closes the capture), and our end of its channel."""
    channel, theirs = Channel.pair()
    package_root = str(Path(kvscope.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "PYTHONPATH": package_root if not path else f"{package_root}{os.pathsep}{path}",
        **WRITER_THREADS,
    }
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvscope.telemetry.writer", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
            process_group=0,
        )
    finally:
        theirs.close()
    channel.send(("start", settings.to_plain()))
    return channel, process


def _convert_slots(items: list[Any], deferred: list[tuple[int, Any]]) -> None:
    """Replace each deferred slots value in `items` by an int64 array: torch tensors by one
    concatenation per device (one copy off a GPU), anything else one by one."""
    tensors: dict[Any, list[tuple[int, Any]]] = {}
    for position, slots in deferred:
        if type(slots).__module__.startswith("torch"):
            tensors.setdefault(slots.device, []).append((position, slots))
        else:
            items[position] = np.ascontiguousarray(slots, np.int64).reshape(-1)
    for group in tensors.values():
        import torch  # NOTE: only when a producer passed tensors, so torch is already loaded

        joined = torch.cat([t.reshape(-1) for _, t in group]).to(torch.int64).cpu().numpy()
        ends = np.cumsum([t.numel() for _, t in group])
        for (position, _), piece in zip(group, np.split(joined, ends[:-1]), strict=True):
            items[position] = piece


def _routing_fields(routing: Routing | None) -> tuple[str | None, int | None, int | None]:
    """The requests row's dispatch, routed_cached_tokens and elsewhere_cached_tokens."""
    if routing is None:
        return (None, None, None)
    return (routing.dispatch, routing.routed_cached_tokens, routing.elsewhere_cached_tokens)


def _plain(value: Any) -> Any:
    """A value marshal carries: numpy scalars and Enum members as plain values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


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
