"""A recorder for a process that cannot import SQLAlchemy (a real engine's venv, where the vLLM
probe runs): RemoteRecorder buffers exactly as SQLRecorder does and hands its batches to a host
process, started with an interpreter that has kvscope's dependencies, which owns the run (an
SQLRecorder and its writer process).

    python -m kvscope.telemetry.remote FD      (started by RemoteRecorder; FD: its end of the channel)

NOTE: the three processes
    recording process  (the engine) RemoteRecorder: record() extends a flat list (packed.ITEM_FIELDS,
                       slots as lists or tuples of ints; item_sink() hands a hot caller that list's
                       extend; event_stream() gives one the EventStream below instead: flat
                       values, no per-event tuple to marshal); event_block() puts many events as columns
                       in one item (EVENT_BLOCK below), the other records append plain rows; at a step
                       past `flush_interval_s`, at idle points and on flush() the buffer goes to
                       the host as one marshal body. Imports: the standard library, channel.py.
    host process       SQLRecorder(target): starts the run, takes each batch into its buffer
                       (extend_items, usage, leak_check, census_blocks, request, tree_snapshot) and
                       hands it on. It detaches
                       (a second fork, a session of its own) so that an engine killing its own
                       process tree at shutdown (vLLM does) leaves it to close the run.
    writer process     SQLRecorder's own: packs and writes.
NOTE: messages (channel.py frames)
    recorder -> host   ("open", target, level, label, config JSON, retention (keep_events_s, max_bytes)
                       or None), then ("batch", step) with body
                       marshal of (items, rows, stream: EventStream.pending() or None; the host
                       appends its events after the items and notes the stream's hot records in a
                       StreamLedger), ("ledger",) with body marshal of slots (who last took and
                       released them), ("flush",), ("close", status, error)
    host -> recorder   ("opened", run_id) or ("failed", one line); ("flushed",) / ("closed",) /
                       ("ledger",) with body marshal of (takers, releasers) / ("failed", one line) later
A host that dies, a full disk or a bad target stop recording: one line on stderr, later records
are dropped, the engine goes on. Nothing here raises into the recording process after __init__.
NOTE: how a run closes. Its owner's close(status) (the probe's: at the engine's shutdown); a process
that exits before that closes it by how it ends (exits.py: finished only for a normal end; crashed
with the exception's line, interrupted, or crashed "exited with code N"); a process killed before
either leaves it to the host, which closes it crashed ("... ended without closing the run (killed)").
"""

from __future__ import annotations

import atexit
import json
import marshal
import multiprocessing.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from enum import StrEnum
from itertools import chain, repeat
from pathlib import Path
from typing import Any

import kvscope
from kvscope.telemetry.channel import Channel, ChannelClosed
from kvscope.telemetry.events import EventKind, EvictReason, PoolName, Recorder
from kvscope.telemetry.exits import exit_status, watch_exits
from kvscope.telemetry.records import CensusBlock, LeakCheck, RequestRecord, Routing, UsageSample
from kvscope.telemetry.retention import Retention

OPEN_TIMEOUT_S = 60.0  # NOTE: the host imports SQLAlchemy and creates the run (a second or two; more on a busy CPU)
_monotonic = time.monotonic
_monotonic_ns = time.monotonic_ns


# NOTE: EventStream, the hot callers' event buffer (RemoteRecorder.event_stream()): events as plain
# values (ints, str and None) laid end to end in one list and their slots in another, handed on as
# they are (marshal writes a small int or a repeated str in about 12 ns; a tuple per event with a
# tuple of slots cost about 230 ns to marshal). Records, by their first value:
#   CLOCK, step, t_ns                    the step and time.monotonic_ns() of the events after it
#   kind, rid, aux, num_slots            an event of that step (kind: alloc, lock, revive, free, unlock):
#                                        pool full, num_tokens = num_slots, node_id and reason None
#   "evict", rid, aux, num_tokens        an eviction (one slot, the block: node_id), reason capacity
#   EVENT, step, t_ns, kind, pool, rid, node_id, num_tokens, aux, reason, principal, num_slots
#                                        any event (event(), record()); num_slots -1: slots None
#   slots  every event's slots, end to end, in the records' order
CLOCK, EVENT = -2, -3
HOT_KINDS = frozenset(
    k._value_ for k in (EventKind.ALLOC, EventKind.LOCK, EventKind.REVIVE, EventKind.FREE, EventKind.UNLOCK)
)
_EVICT, _FULL, _CAPACITY = EventKind.EVICT._value_, PoolName.FULL._value_, EvictReason.CAPACITY._value_
_RELEASES = frozenset(k._value_ for k in (EventKind.FREE, EventKind.UNLOCK))


class EventStream:
    """Events as flat records (see the NOTE above) for a hot caller: tick() as a step begins, then
    per event `records.extend` of one record and `slots.append` per block. The lists are cleared in
    place, never replaced, so the caller's bound methods stay valid."""

    def __init__(self, slot_ids: Callable[[list[Any]], list[int]] | None = None) -> None:
        self.records: list[Any] = []
        self.slots: list[Any] = []
        self.clock: tuple[int, int, int] = (CLOCK, 0, 0)  # NOTE: the latest clock record
        self.slot_ids = slot_ids  # NOTE: slots are objects: this gives their ints, once per hand-off

    def tick(self, step: int, t_ns: int) -> None:
        """The step and time of the records that follow."""
        self.clock = clock = (CLOCK, step, t_ns)
        self.records.extend(clock)

    def event(
        self,
        step: int,
        t_ns: int,
        kind: str,
        pool: str | None,
        rid: str | None,
        node_id: int | None,
        num_tokens: int,
        aux: int,
        reason: str | None,
        principal: str | None,
        slots: Any,
    ) -> None:
        """Any event from plain values (kind, pool, reason as their string values; slots ints or None)."""
        num_slots = -1 if slots is None else len(slots)
        if slots is not None:
            self.slots.extend(slots)
        self.records.extend(
            (EVENT, step, t_ns, kind, pool, rid, node_id, num_tokens, aux, reason, principal, num_slots)
        )

    def has_events(self) -> bool:
        records = self.records
        return len(records) > 3 or (bool(records) and records[0] != CLOCK)

    def pending(self) -> tuple[list[Any], list[int]] | None:
        """The buffered (records, slots) themselves (no copy: marshal them, then clear()), slot
        objects mapped to their ints in place; None: no event."""
        if not self.has_events():
            return None
        if self.slot_ids is not None:
            self.slots[:] = self.slot_ids(self.slots)
        return (self.records, self.slots)

    def clear(self) -> None:
        """Empty, in place; the step's clock opens the next batch."""
        self.records.clear()
        self.slots.clear()
        self.records.extend(self.clock)


class StreamLedger:
    """The host's ledger of an event stream's slots: the last (rid, step, kind) that took each slot
    (alloc, lock, revive) and that released it (free, unlock), from the hot records, so that a hot
    caller keeps none on its own thread and asks for the few slots its census names
    (RemoteRecorder.stream_ledger)."""

    def __init__(self) -> None:
        self.takers: dict[int, tuple[str | None, int, str]] = {}
        self.releasers: dict[int, tuple[str | None, int, str]] = {}

    def note(self, kind: str, rid: str | None, step: int, slots: list[int]) -> None:
        book = self.releasers if kind in _RELEASES else self.takers
        book.update(zip(slots, repeat((rid, step, kind))))

    def answer(self, slots: list[int]) -> tuple[dict[int, Any], dict[int, Any]]:
        takers, releasers = self.takers, self.releasers
        return (
            {s: takers[s] for s in slots if s in takers},
            {s: releasers[s] for s in slots if s in releasers},
        )


def stream_as_items(records: list[Any], slots: list[int], ledger: StreamLedger | None = None) -> list[Any]:
    """EventStream.pending()'s batch as the flat ITEM_FIELDS items SQLRecorder.extend_items takes
    (slots as int64 arrays, t_mono in seconds); `ledger`: its hot records noted there too. Slots
    past the last event's are a hot caller's that failed before its record (recording stopped
    there): dropped."""
    import numpy as np  # NOTE: the host's interpreter (the engine side imports the standard library only)

    slot_values = np.asarray(slots, np.int64)  # NOTE: each event's slots a view of it
    items: list[Any] = []
    add = items.extend
    step, t_mono, at, r = 0, 0.0, 0, 0
    while r < len(records):
        head = records[r]
        if head == CLOCK:
            step, t_mono = records[r + 1], records[r + 2] / 1e9
            r += 3
        elif head == EVENT:
            step_of, t_ns, kind, pool, rid, node, num_tokens, aux, reason, principal, num_slots = records[
                r + 1 : r + 12
            ]
            r += 12
            taken = None if num_slots < 0 else _slots_at(slot_values, at, num_slots)
            at += max(num_slots, 0)
            add((step_of, t_ns / 1e9, kind, pool, rid, node, num_tokens, aux, reason, principal, taken))
        elif head == _EVICT:
            rid, aux, num_tokens = records[r + 1 : r + 4]
            r += 4
            taken, at = _slots_at(slot_values, at, 1), at + 1
            add((step, t_mono, _EVICT, _FULL, rid, int(taken[0]), num_tokens, aux, _CAPACITY, None, taken))
        elif head in HOT_KINDS:
            rid, aux, num_slots = records[r + 1 : r + 4]
            r += 4
            taken = _slots_at(slot_values, at, num_slots)
            if ledger is not None:
                ledger.note(head, rid, step, slots[at : at + num_slots])
            at += num_slots
            add((step, t_mono, head, _FULL, rid, None, num_slots, aux, None, None, taken))
        else:
            raise ValueError(f"an event stream record starts with {head!r}")
    return items


# NOTE: an event block (RemoteRecorder.event_block): many events as columns in one item of the flat
# list, for a caller that has them in bulk (the SGLang probe's fold): no Python object per event on
# the recording side. The item is EVENT_BLOCK then the block, then None to the item's width; the host
# reads it back as the same events' items at its place (blocks_as_items). The block, a tuple:
#   times, now              dict step -> t_mono (s); an event whose step it lacks gets `now`
#   steps                   a sequence of ints, one per event
#   kinds, kind_names       bytes, one int8 code per event, and the names they index
#   pools, pool_names       the same for pool
#   rids                    a sequence, one str or None per event
#   num_tokens, num_slots   bytes, int64 per event
#   slots                   bytes, int64: every event's slots end to end
# node_id None, aux 0, reason None, principal None for every event of a block.
EVENT_BLOCK: Any = ...  # NOTE: in an item's step field (a real item's step is an int)
_ITEM_WIDTH = 11  # NOTE: packed.ITEM_WIDTH (packed imports numpy; this side the standard library only)


def block_as_items(block: tuple[Any, ...]) -> list[Any]:
    """An event block's events as flat ITEM_FIELDS items (slots as int64 arrays)."""
    import numpy as np  # NOTE: the host's interpreter

    times, now, steps, kinds, kind_names, pools, pool_names, rids, num_tokens, num_slots, slots = block
    counts = np.frombuffer(num_slots, np.int64)
    if len(steps) != len(kinds) or len(counts) != len(steps) or int(counts.sum()) * 8 != len(slots):
        raise ValueError("an event block's columns disagree in length")
    pieces = np.split(np.frombuffer(slots, np.int64), np.cumsum(counts)[:-1]) if len(counts) else []
    return list(
        chain.from_iterable(
            zip(
                steps,
                map(times.get, steps, repeat(now)),
                map(kind_names.__getitem__, kinds),
                map(pool_names.__getitem__, pools),
                rids,
                repeat(None),
                np.frombuffer(num_tokens, np.int64).tolist(),
                repeat(0),
                repeat(None),
                repeat(None),
                pieces,
                strict=False,
            )
        )
    )


def blocks_as_items(items: list[Any]) -> list[Any]:
    """The flat items with each event block read back as its events' items, in place."""
    if EVENT_BLOCK not in items[::_ITEM_WIDTH]:
        return items
    out: list[Any] = []
    for at in range(0, len(items), _ITEM_WIDTH):
        if items[at] is EVENT_BLOCK:
            out += block_as_items(items[at + 1])
        else:
            out += items[at : at + _ITEM_WIDTH]
    return out


def _slots_at(slot_values: Any, at: int, num_slots: int) -> Any:
    if at + num_slots > len(slot_values):
        raise ValueError("an event stream has fewer slots than its events")
    return slot_values[at : at + num_slots]


class RecorderStartError(Exception):
    """The host could not start the run (a bad target, a missing interpreter): one line."""


class RemoteRecorder(Recorder):
    def __init__(
        self,
        target: str | Path,
        *,
        level: str = "full",
        label: str = "",
        config: dict[str, Any] | None = None,
        python: str | None = None,
        flush_interval_s: float = 0.2,
        retention: tuple[float | None, int | None] | None = None,
    ) -> None:
        """`retention`: what the host keeps of the events (retention.Retention's keep_events_s,
        max_bytes; never gated: a probe's verdict is its census, not a ledger replay)."""
        if level not in ("summary", "full"):
            raise RecorderStartError(f"recording level must be 'summary' or 'full', got {level!r}")
        self.level = level
        self.enabled = level == "full"
        self.summary_enabled = True
        self.failure: str | None = None
        self.closed = False
        self._pid = os.getpid()
        self._step = 0
        self._items: list[Any] = []
        self._stream: EventStream | None = None  # NOTE: once event_stream() is asked for, record() writes there
        self._rows: list[tuple[str, tuple[Any, ...]]] = []
        self._interval_s = flush_interval_s
        self._due_s = _monotonic() + flush_interval_s
        self._channel, self._process = _start_host(python or sys.executable)
        self._retention = retention
        self.run_id = self._open(str(target), level, label, config or {})
        # NOTE: a process that exits before its owner closed the run closes it by how it ends
        # (exits.py: finished only for a normal end); a multiprocessing child (vLLM's EngineCore)
        # skips atexit and runs multiprocessing's finalizers instead
        watch_exits()
        atexit.register(self._close_at_exit)
        self._finalizer = multiprocessing.util.Finalize(None, self._close_at_exit, exitpriority=100)

    def _open(self, target: str, level: str, label: str, config: dict[str, Any]) -> int:
        try:
            self._channel.send(
                ("open", target, level, label, json.dumps(config, default=str, sort_keys=True), self._retention)
            )
            answer = self._channel.receive(OPEN_TIMEOUT_S)
        except ChannelClosed:
            answer = None
        if answer is None or answer.kind != "opened":
            reason = (
                str(answer.header[1])
                if answer is not None and answer.kind == "failed"
                else "the recorder's host process did not start the run"
            )
            self._end_host()
            raise RecorderStartError(reason)
        self.host_pid = int(answer.header[2])
        self._process.wait()  # NOTE: the first process, which forked the host off, has exited
        return int(answer.header[1])

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        if _monotonic() >= self._due_s:
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
        if self._stream is not None:
            self._stream.event(
                self._step,
                _monotonic_ns(),
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
            return
        self._items.extend(
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

    def item_sink(self) -> Any:
        """The bound `extend` of the event buffer, for a caller on a hot path (the vLLM probe's
        wrappers) that builds the flat ITEM_FIELDS tuple itself, as record() would. The buffer is
        cleared in place at each hand-off, never replaced, so the bound method stays valid."""
        return self._items.extend

    def event_block(self, block: tuple[Any, ...]) -> None:
        """Many events as columns (the EVENT_BLOCK layout above), at this point of the event
        buffer; they read back as the same events given to item_sink() one by one. For an
        item_sink() caller (not with event_stream())."""
        self._items.extend((EVENT_BLOCK, block, None, None, None, None, None, None, None, None, None))

    def event_stream(self) -> EventStream:
        """The event buffer as an EventStream, for a hot caller that appends its events there
        itself; from then on record() writes there too (one stream: seq keeps the order). A caller
        uses this or item_sink(), not both."""
        if self._stream is None:
            self._stream = EventStream()
        return self._stream

    def usage(self, sample: UsageSample) -> None:
        self._rows.append(("usage", _plain_tuple(sample)))

    def leak_check(self, check: LeakCheck) -> None:
        self._rows.append(("leak_checks", _plain_tuple(check)))

    def census_blocks(self, blocks: list[CensusBlock]) -> None:
        self._rows.extend([("census_blocks", _plain_tuple(block)) for block in blocks])

    def request(self, rec: RequestRecord) -> None:
        self._rows.append(
            (
                "requests",
                (
                    rec.rid,
                    rec.principal,
                    str(rec.status),
                    rec.prompt_len,
                    rec.cached_tokens,
                    rec.output_len,
                    rec.num_retractions,
                    dict(rec.times),
                    dict(rec.steps),
                    None if rec.routing is None else tuple(vars(rec.routing).values()),
                ),
            )
        )

    def tree_snapshot(self, step: int, rows: list[Any]) -> None:
        self._rows.append(("tree_snapshots", (step, [tuple(row) for row in rows])))

    def idle(self) -> None:
        if self._items or self._rows or (self._stream is not None and self._stream.has_events()):
            self._hand_off()

    def flush(self) -> None:
        """Block until everything recorded so far is handed on by the host (its writer writes it)."""
        self._hand_off()
        self._ask(("flush",), "flushed")

    def close(self, status: str = "finished", error: str | None = None) -> None:
        if self.closed or os.getpid() != self._pid:
            return
        self.closed = True
        with signals_held():  # NOTE: a SIGTERM after the last batch must not cut the close off (vLLM sends two)
            self._hand_off()
            self._ask(("close", status, error), "closed")
        self._end_host()
        atexit.unregister(self._close_at_exit)
        self._finalizer.cancel()

    def _close_at_exit(self) -> None:
        """The process ends and its owner did not close the run: closed by how it ends (exits.py)."""
        self.close(*exit_status())

    def _hand_off(self) -> None:
        self._due_s = _monotonic() + self._interval_s
        items, rows = self._items, self._rows
        stream = None if self.failure is not None or self._stream is None else self._stream.pending()
        if self.failure is not None or (not items and not rows and stream is None):
            items.clear()
            rows.clear()
            if self._stream is not None:
                self._stream.clear()
            return
        try:
            body = marshal.dumps((items, rows, stream))
            with signals_held():
                self._channel.send(("batch", self._step), body)
        except (ValueError, TypeError) as err:
            self._stop(f"a record could not be handed on ({err})")
        except (ChannelClosed, OSError):
            self._stop("the recorder's host process ended")
        items.clear()
        rows.clear()
        if self._stream is not None:
            self._stream.clear()
        self._read_answers()

    def stream_ledger(self, slots: list[int]) -> tuple[dict[int, Any], dict[int, Any]] | None:
        """Who last took and released each of `slots`, from the host's ledger of the event stream
        (everything recorded so far is handed on first): ({slot: (rid, step, kind)} of takers, of
        releasers); None when recording has stopped (nobody can say)."""
        if self.closed:
            return None
        self._hand_off()
        if self.failure is not None:
            return None
        try:
            with signals_held():
                self._channel.send(("ledger",), marshal.dumps(list(slots)))
            while True:
                answer = self._channel.receive()
                if answer is None:
                    continue
                if answer.kind == "ledger":
                    takers, releasers = marshal.loads(answer.body)
                    answer.release()
                    return takers, releasers
                if answer.kind == "failed":
                    self._stop(str(answer.header[1]))
                    return None
        except (ChannelClosed, OSError):
            self._stop("the recorder's host process ended")
        return None

    def _read_answers(self) -> None:
        try:
            answers = self._channel.poll()
        except (ChannelClosed, OSError):
            self._stop("the recorder's host process ended")
            return
        for answer in answers:
            if answer.kind == "failed":
                self._stop(str(answer.header[1]))

    def _ask(self, question: tuple[Any, ...], expected: str) -> None:
        if self.failure is not None:
            return
        try:
            with signals_held():
                self._channel.send(question)
            while True:
                answer = self._channel.receive()
                if answer is None or answer.kind == expected:
                    return
                if answer.kind == "failed":
                    self._stop(str(answer.header[1]))
        except (ChannelClosed, OSError):
            self._stop("the recorder's host process ended")

    def _stop(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            print(f"kvscope recorder: recording stopped: {reason}", file=sys.stderr, flush=True)

    def _end_host(self) -> None:
        self._channel.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()


def _plain_tuple(record: tuple[Any, ...]) -> tuple[Any, ...]:
    """A NamedTuple (nested ones too) as plain tuples: marshal carries only exact tuples."""
    return tuple(_plain_tuple(v) if isinstance(v, tuple) else v for v in record)


def _start_host(python: str) -> tuple[Channel, subprocess.Popen[bytes]]:
    """The host, through a first process that forks it off and exits (_detach)."""
    channel, theirs = Channel.pair()
    package_root = str(Path(kvscope.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": package_root if not path else f"{package_root}{os.pathsep}{path}"}
    try:
        process = subprocess.Popen(
            [python, "-m", "kvscope.telemetry.remote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
            process_group=0,
        )
    except OSError as err:
        channel.close()
        raise RecorderStartError(f"cannot start the recorder's host process with {python}: {err}") from err
    finally:
        theirs.close()
    return channel, process


# -- the host process (kvscope's own interpreter: SQLAlchemy is imported here only) ----------------

_HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while one message goes out.

    NOTE: an engine's handler may raise on a signal (vLLM's EngineCore raises SystemExit on SIGTERM);
    raised in the middle of a send, it would cut a message in two, the host would read the rest as
    garbage, and the close that follows would never reach it (the run would end 'interrupted').
    Python runs signal handlers in the main thread only, so a send from another thread is never cut;
    in the main thread the engine's handlers are set aside for the send and whatever arrived meanwhile
    is handed to them once it returns. (A thread signal mask does not do this: the engine has other
    threads, and the kernel hands a process-wide signal to any thread that does not block it.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, Any]] = []
    set_aside: dict[int, Any] = {}
    try:
        for signum in _HELD_SIGNALS:
            handler = signal.getsignal(signum)
            if handler is None or handler == signal.SIG_IGN:
                continue  # installed outside Python (cannot be put back) or ignored: left alone
            set_aside[signum] = signal.signal(signum, lambda n, frame: pending.append((n, frame)))
        yield
    finally:
        for held, handler in set_aside.items():
            signal.signal(held, handler)
        for arrived, frame in pending:
            handler = set_aside[arrived]
            if callable(handler):
                handler(arrived, frame)
            else:  # SIG_DFL: the default action, now that the message is out
                signal.raise_signal(arrived)


def _host(channel: Channel) -> None:
    from kvscope.telemetry.recorder import SQLRecorder
    from kvscope.telemetry.records import PoolTerms

    first = channel.receive()
    assert first is not None and first.kind == "open", "the recorder speaks first"
    _, target, level, label, config, retention = first.header
    try:
        recorder = SQLRecorder(
            target,
            level=level,
            label=label,
            config=json.loads(config),
            retention=None if retention is None else Retention(*retention),
        )
    except Exception as err:
        channel.send(("failed", str(err).splitlines()[0] if str(err) else type(err).__name__))
        return
    channel.send(("opened", recorder.run_id, os.getpid()))
    # NOTE: the recording process died without closing (SIGKILL, a signal's default action, os._exit)
    status: tuple[str, str | None] = ("crashed", "the recording process ended without closing the run (killed)")
    ledger = StreamLedger()
    try:
        while True:
            try:
                message = channel.receive()
            except ChannelClosed:
                break
            if message is None:
                continue
            if message.kind == "batch":
                items, rows, stream = marshal.loads(message.body)
                message.release()
                try:
                    items = blocks_as_items(items)
                except ValueError as err:
                    channel.send(("failed", f"a batch of events could not be read: {err}"))
                    items = []
                if stream is not None:
                    try:
                        records, slots = stream
                        items.extend(stream_as_items(records, slots, ledger))
                    except ValueError as err:  # NOTE: the batch's other records are still taken
                        channel.send(("failed", f"a batch of events could not be read: {err}"))
                _take(recorder, items, rows, PoolTerms)
                recorder.step = max(recorder.step, int(message.header[1]))
                recorder.idle()  # NOTE: a batch arrives at most every flush interval, or at an idle point
                if recorder.failure is not None:
                    channel.send(("failed", recorder.failure))
            elif message.kind == "flush":
                recorder.flush()
                channel.send(("flushed",))
            elif message.kind == "ledger":
                asked = marshal.loads(message.body)
                message.release()
                channel.send(("ledger",), marshal.dumps(ledger.answer(asked)))
            elif message.kind == "close":
                status = (str(message.header[1]), message.header[2])
                break
    finally:
        recorder.close(*status)
    with suppress(ChannelClosed):
        channel.send(("closed",))


def _take(recorder: Any, items: list[Any], rows: list[tuple[str, tuple[Any, ...]]], pool_terms: Any) -> None:
    recorder.extend_items(items)
    for table, row in rows:
        if table == "usage":
            full, swa, host = row[1], row[2], row[13]
            counts = dict(zip(UsageSample._fields[3:13], row[3:13], strict=True))
            later = dict(zip(UsageSample._fields[14:], row[14:], strict=True))
            recorder.usage(
                UsageSample(
                    row[0],
                    pool_terms(*full),
                    swa and pool_terms(*swa),
                    host=host and pool_terms(*host),
                    **counts,
                    **later,
                )
            )
        elif table == "leak_checks":
            recorder.leak_check(LeakCheck(*row))
        elif table == "census_blocks":
            recorder.census_blocks([CensusBlock(*row)])
        elif table == "tree_snapshots":
            recorder.tree_snapshot(row[0], row[1])
        elif table == "requests":
            rid, principal, status, prompt_len, cached, output_len, retractions, times, steps, routing = row
            recorder.request(
                RequestRecord(
                    rid,
                    principal,
                    prompt_len,
                    status,
                    cached,
                    output_len,
                    retractions,
                    times,
                    steps,
                    None if routing is None else Routing(*routing),
                )
            )


def _detach() -> None:
    """Leave the recording process's tree: the first child exits at once (RemoteRecorder reaps it),
    the second, in a session of its own, is the host."""
    if os.fork() != 0:
        os._exit(0)
    os.setsid()


def main(argv: list[str]) -> int:
    _detach()
    channel = Channel.from_fd(int(argv[0]))
    try:
        _host(channel)
    except Exception as err:
        print(f"kvscope recorder: the host process stopped: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
