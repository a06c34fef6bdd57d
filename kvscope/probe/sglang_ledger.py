"""The SGLang probe's page ledger: whom each page was last taken by and released for, kept in bulk.

The allocator hooks and the bind only queue their index tensors (`PageLedger.pending`, no read per
call; a Mamba slot call, most often, no tensor: see PageLedger.slot_runs), as FIELDS plain values laid
end to end (no tuple kept per call: see FIELDS); a fold takes the queue in
call order into the ledgers (a numpy array per pool and per Mamba slot allocator, page -> entry id)
and, at level full, emits one alloc / free event per allocator call. The probe folds every
FOLD_INTERVAL_S or FOLD_CALLS entries on a worker thread of the ledger's own (fold_later: the engine
thread only takes the queue), and at each census and at exit on the engine thread, after what the
worker was handed (drain). Imports: stdlib and numpy (torch is the engine's, found in sys.modules,
never imported here).
"""

from __future__ import annotations

import operator
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import compress, repeat
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from kvscope.telemetry import EventKind

KIND_NAMES = (EventKind.ALLOC._value_, EventKind.FREE._value_)  # NOTE: an event block's kinds, by ALLOC / FREE
ALLOC, FREE, BIND = 0, 1, 2  # NOTE: what a pending entry records
FOLD_CALLS = 512  # NOTE: pending entries that fold at the next step (else every FOLD_INTERVAL_S, and at a census)
# NOTE: a pending entry is FIELDS values appended to the flat queue (PageLedger.pending.extend((kind, ...))),
# not a tuple kept per call: a kept tuple is one more object for each of Python's cyclic GC collections
# to scan and promote (what is kept until a fold sets one off about every 550 calls: ~0.3 µs per call)
FIELDS = 7
FOLD_INTERVAL_S = 0.2  # NOTE: as the recorder's hand-off: a step's events wait at most this long
WORKER_POLL_S = 1.0  # NOTE: how often an idle fold worker looks whether its ledger is gone
NO_RUN: list[Any] = [None, None, 0, 0, 0, None]  # NOTE: no open slot run (never written: a free starts a new list)
_monotonic = time.monotonic
Entry = tuple[str | None, int, str]  # NOTE: (rid, step, event), as sglang_census
Pending = tuple[int, Any, Any, int, str, Any, Any]  # NOTE: (ALLOC/FREE/BIND, allocator, rid or a bind's rids,
# step, event, index tensor, None or a bind's slots per request): one entry's FIELDS values, as queued


class Calls(NamedTuple):
    """A fold's (or one fold group's) recorded calls, as columns (the Pending fields)."""

    kinds: tuple[int, ...]
    allocators: tuple[Any, ...]
    rids: tuple[Any, ...]
    steps: tuple[int, ...]
    events: tuple[str, ...]
    tensors: tuple[Any, ...]
    parts: tuple[Any, ...]


def _pick(columns: Calls, where: np.ndarray, allocator: Any, binds: bool) -> Calls:
    """One fold group's calls (the fold's calls at `where`, all made on `allocator`), only the
    columns fold_group reads: kinds and parts where binds or a slot allocator's places need them."""
    pick = _picker(where.tolist())
    slots = binds or getattr(allocator, "page_size", None) is None
    return Calls(
        pick(columns.kinds) if slots else (),
        (allocator,),
        pick(columns.rids),
        pick(columns.steps),
        pick(columns.events),
        pick(columns.tensors),
        pick(columns.parts) if slots else (),
    )


def _picker(where: list[int]) -> Callable[[Any], tuple[Any, ...]]:
    """The items at `where` of a column, as a tuple (itemgetter, which gives no tuple for one)."""
    if len(where) == 1:
        at = where[0]
        return lambda column: (column[at],)
    return itemgetter(*where)


class Ledger(Mapping[int, Entry]):
    """page -> the last (rid, step, event) written for it: an entry id per page in a numpy array
    (-1: none), the entries as three columns (compacted when they outgrow the pages). Entry ids only
    grow between compactions, so a page's last writer is its largest id."""

    def __init__(self) -> None:
        self.ids = np.full(0, -1, np.int64)
        self.rids: list[str | None] = []
        self.steps: list[int] = []
        self.events: list[str] = []

    def write(self, pages: np.ndarray, segs: np.ndarray, rids: Any, steps: Any, events: Any) -> None:
        """pages[j] was written by entry segs[j] = (rids[i], steps[i], events[i]); segs ascending
        (in call order): a later write wins."""
        if not len(pages):
            return
        top = int(pages.max()) + 1
        if top > len(self.ids):
            grown = np.full(max(top, 2 * len(self.ids)), -1, np.int64)
            grown[: len(self.ids)] = self.ids
            self.ids = grown
        np.maximum.at(self.ids, pages, segs + len(self.rids))  # NOTE: above every id written before
        self.rids.extend(rids)
        self.steps.extend(steps)
        self.events.extend(events)
        if len(self.rids) > 2 * len(self.ids) + 1024:
            self.compact()

    def compact(self) -> None:
        held = self.ids >= 0
        kept, self.ids[held] = np.unique(self.ids[held], return_inverse=True)
        keep = kept.tolist()
        self.rids = [self.rids[i] for i in keep]
        self.steps = [self.steps[i] for i in keep]
        self.events = [self.events[i] for i in keep]

    def __getitem__(self, page: int) -> Entry:
        i = int(self.ids[page]) if 0 <= page < len(self.ids) else -1
        if i < 0:
            raise KeyError(page)
        return self.rids[i], self.steps[i], self.events[i]

    def __contains__(self, page: object) -> bool:
        return isinstance(page, int) and 0 <= page < len(self.ids) and self.ids[page] >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self.ids >= 0).tolist())

    def __len__(self) -> int:
        return int(np.count_nonzero(self.ids >= 0))


class Batch(NamedTuple):
    """The calls taken for one fold (PageLedger.take): the flat queue, the Mamba slot runs, the
    steps' clock reads; the take's clock read; whether its events are asked for (level full)."""

    pending: list[Any]
    runs: list[list[Any]]
    times: dict[int, float]
    now: float
    events: bool


class PageLedger:
    """The queue of allocator calls and binds not yet folded, and the ledgers they fold into: per
    pool (full, swa; req rows are a dict the row hooks write at once) the last taker and releaser of
    each page."""

    def __init__(self) -> None:
        self.pending: list[Any] = []  # NOTE: allocator calls and binds not yet folded, in order: Pending values, flat
        # NOTE: req rows: a dict; mamba: id(MambaSlotAllocator) -> its Ledger (an int8 checkpoint pool or a
        # draft head has its own allocator)
        self.takers: dict[str, Any] = {"full": Ledger(), "swa": Ledger(), "req": {}, "mamba": {}}
        self.releasers: dict[str, Any] = {"full": Ledger(), "swa": Ledger(), "req": {}, "mamba": {}}
        self.pools: dict[int, str] = {}  # id(sub-allocator) -> "swa" (anything else is full)
        # NOTE: the slot allocators' frees since the last fold keep their slots in runs, in call order:
        # [allocator, the run's latest free_slots, bytes of its tail freed in the run, its bytes, item
        # size, its chain], the open one last. A chain is (the free_slots it began with, `pops` then):
        # its slots in FIFO order are that free_slots, then what its runs hold; the probe's Mamba
        # alloc hook queues a pop off it by its place in `pops` (all slot allocators' pops, counted)
        self.slot_runs: list[list[Any]] = []
        self.slot_run: list[Any] = NO_RUN
        self.pops = 0
        self.folded_at = _monotonic()
        self.step_now: dict[int, float] = {}  # NOTE: step -> its clock read (the t_mono of its folded events)
        # NOTE: taken batches not folded yet (in order), and folded event blocks not handed to the recorder
        # yet; the fold's lock (held by whichever thread folds: the worker, or drain's caller), the worker
        self.batches: deque[Batch] = deque()
        self.blocks: deque[tuple[Any, ...]] = deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.worker: threading.Thread | None = None
        self.worker_pid = -1
        self.failure: Exception | None = None  # NOTE: a background fold's error, for the engine thread

    def due(self, now: float) -> bool:
        """A fold every FOLD_CALLS entries or FOLD_INTERVAL_S (the probe asks once per step)."""
        return len(self.pending) >= FOLD_CALLS * FIELDS or now - self.folded_at >= FOLD_INTERVAL_S

    def pool_of(self, allocator: Any) -> str:
        return self.pools.get(id(allocator), "full")

    def drain(self, step: int, emit: Callable[[tuple[Any, ...]], None] | None) -> float | None:
        """Fold the allocator calls and binds recorded since the last fold into the ledger, in
        order, and (level full) their alloc / free events in call order as one event block (`emit`:
        the recorder's event_block; None at level summary), on the calling thread: first what a
        background fold (fold_later) has queued or is folding, so the ledgers are exact when this
        returns. Per allocator and ledger one concatenation, one transfer off the device and a few
        numpy passes; per call only C-level passes over the recorded columns, no Python object per
        call. `step`: the step now (its clock read stays). The fold's clock read, None when nothing
        was pending."""
        now = self.take(step, emit is not None)
        if self.worker is not None and self.worker_pid != os.getpid():  # NOTE: forked: the parent's worker is gone
            self.lock, self.worker = threading.Lock(), None
        with self.lock:
            self.fold_queued()
        self.hand_over(emit)
        return now

    def fold_later(self, step: int, events: bool) -> float | None:
        """drain's work, off the calling (the engine's) thread: the queue is taken here (take), and a
        worker thread of the ledger's own folds it; its event block goes to the recorder at the
        caller's next hand_over. The fold's clock read, None when nothing was pending."""
        now = self.take(step, events)
        if now is not None:
            if self.worker_pid != os.getpid():  # NOTE: none yet, or forked (a fork keeps no thread but its own)
                self.start_worker()
            self.wake.set()
        return now

    def take(self, step: int, events: bool) -> float | None:
        """The calls queued so far, the Mamba runs and the steps' clock reads, as one Batch for a
        fold, in order (caller: the thread the Mamba hooks run on, the engine's). The queue is taken
        by a copy and a delete of exactly what was copied: a call another thread queues meanwhile
        stays queued (a clear would lose it)."""
        pending = self.pending[:]
        if not pending:
            return None
        del self.pending[: len(pending)]  # NOTE: emptied in place: the probe's hooks hold this list
        runs, self.slot_runs = self.slot_runs, []
        if self.slot_run is not NO_RUN:  # NOTE: the open run goes on as a new chain: it begins with what is free now
            run = self.slot_run
            self.slot_run = run = [run[0], run[1], 0, run[3], run[4], (run[1], self.pops)]
            self.slot_runs.append(run)
        self.folded_at = now = _monotonic()
        times, self.step_now = self.step_now, {step: self.step_now.get(step, now)}
        self.batches.append(Batch(pending, runs, times, now, events))
        return now

    def fold_queued(self) -> None:
        """Fold the batches taken so far, oldest first, each into the ledgers and its event block
        onto `blocks` (caller: holds `lock`, so only one thread folds and the batches fold in order).
        A batch's tensors are let go here: on a worker, SGLang's index tensors are freed there."""
        while self.batches:
            batch = self.batches.popleft()
            block = self.fold(batch)
            if block is not None:
                self.blocks.append(block)
            del batch

    def hand_over(self, emit: Callable[[tuple[Any, ...]], None] | None) -> None:
        """The folded event blocks to the recorder (`emit`; None: dropped), oldest first, on the
        caller's thread (the engine's: the recorder's buffer is not written from the worker); a
        failed background fold's error raised here, where the caller's guard stops recording."""
        if self.failure is not None:
            err, self.failure = self.failure, None
            raise err
        while self.blocks:
            block = self.blocks.popleft()
            if emit is not None:
                emit(block)

    def start_worker(self) -> None:
        """The background fold's thread (a daemon: at exit the probe's drain folds what is left). It
        holds the ledger weakly: it ends within WORKER_POLL_S of the ledger's end (a probe's lasts as
        long as its process)."""
        self.lock = threading.Lock()  # NOTE: after a fork a lock the parent's worker held stays held
        self.wake = threading.Event()
        self.worker_pid = os.getpid()
        self.worker = threading.Thread(
            target=_work, args=(weakref.ref(self), self.wake), name="kvscope-sglang-fold", daemon=True
        )
        self.worker.start()

    def fold_woken(self) -> None:
        """The worker's part each time it is woken: fold what was taken; a failure is kept for the
        engine thread (hand_over), never raised on the worker, and what was left to fold dropped."""
        try:
            with self.lock:
                self.fold_queued()
        except Exception as err:
            self.failure = err
            with self.lock:
                self.batches.clear()

    def fold(self, batch: Batch) -> tuple[Any, ...] | None:
        """One taken batch into the ledgers; its event block (None: no event, or none asked for)."""
        pending, now = batch.pending, batch.now
        n = len(pending) // FIELDS
        columns = Calls(*(tuple(pending[i::FIELDS]) for i in range(FIELDS)))
        kinds, allocators = columns.kinds, columns.allocators
        binds = BIND in kinds
        frees = FREE in kinds
        tails = run_tails(batch.runs)
        folded: list[Folded] = []
        first = allocators[0]
        one = allocators.count(first) == n  # NOTE: one allocator (the common case): no group by allocator
        if one and (not frees or kinds.count(FREE) == n):  # NOTE: one group
            folded.append(self.fold_group(first, not frees, None, columns, binds, tails))
        elif one and getattr(first, "page_size", None) is not None:  # NOTE: one paged allocator (no SWA, no Mamba)
            folded.append(self.fold_mixed(first, columns, binds))
        else:
            takes = np.frombuffer(bytes(kinds), np.int8) != FREE
            if one:  # NOTE: its takes, then its frees: no id per call, no np.unique
                groups = [np.flatnonzero(takes), np.flatnonzero(~takes)]
            else:
                ids = np.fromiter(map(id, allocators), np.int64, n) * 2 + takes
                groups = [np.flatnonzero(ids == group) for group in np.unique(ids).tolist()]
            for where in groups:
                allocator = allocators[where[0]]
                calls = _pick(columns, where, allocator, binds)
                folded.append(self.fold_group(allocator, bool(takes[where[0]]), where, calls, binds, tails))
        if not batch.events:
            return None
        return event_block(kinds, columns.rids, columns.steps, folded, batch.times, now, binds)

    def fold_mixed(self, allocator: Any, calls: Calls, binds: bool) -> Folded:
        """One paged allocator's takes (allocs and binds) and frees together, in one pass: one
        concatenation of all the calls' tensors, each page's call, and a write into the takers' and the
        releasers' ledger, as fold_group gives for the takes and the frees apart (both ledgers are
        given every entry; each keeps the ones whose pages it writes)."""
        page_size = int(allocator.page_size)
        tensors = calls.tensors
        rids: Sequence[Any] = calls.rids
        steps: Sequence[int] = calls.steps
        events: Sequence[str] = calls.events
        frees = np.frombuffer(bytes(calls.kinds), np.int8) == FREE
        if binds:  # NOTE: a bind: one entry per request, parts[i][j] slots each
            rids, steps, events, counts, call_of = _expand_binds(calls)
            entry_frees = np.zeros(len(counts), bool)
            entry_frees[call_of >= 0] = frees[call_of[call_of >= 0]]
        else:
            counts = np.fromiter(map(type(tensors[0]).numel, tensors), np.int64, len(tensors))
            call_of, entry_frees = None, frees
        pages, segs, freed = mixed_pages(_to_numpy(tensors), counts, entry_frees, page_size)
        pool = self.pool_of(allocator)
        self.takers[pool].write(pages[~freed], segs[~freed], rids, steps, events)
        self.releasers[pool].write(pages[freed], segs[freed], rids, steps, events)
        return Folded(pages, segs if call_of is None else call_of[segs], page_size, pool, None)

    def fold_group(
        self,
        allocator: Any,
        takes: bool,
        where: np.ndarray | None,
        calls: Calls,
        binds: bool,
        tails: list[tuple[list[Any], np.ndarray]],
    ) -> Folded:
        """One allocator's takes (allocs and binds) or frees (the fold's calls at `where`, None: all)
        into its ledger; its pages and the fold's call each came from (-1: a bind's: no event). An
        allocator without a page size is a slot allocator (MambaSlotAllocator, pool mamba): one slot a
        page, a ledger of its own, its frees recorded as counts and some pops as places, their slots
        in the fold's runs (`tails`: run_tails)."""
        size = getattr(allocator, "page_size", None)
        page_size = 1 if size is None else int(size)
        tensors = calls.tensors
        rids: Sequence[Any] = calls.rids
        steps: Sequence[int] = calls.steps
        events: Sequence[str] = calls.events
        call_of: np.ndarray | None = None
        if size is None and takes and int in map(type, tensors):  # NOTE: pops queued by their place in a chain
            values, counts = chain_takes(tensors, calls.parts, [t for t in tails if t[0][0] is allocator])
            if binds and BIND in calls.kinds:
                rids, steps, events, counts, call_of = _expand_binds(calls, counts)
        elif binds and BIND in calls.kinds:  # NOTE: a bind: one entry per request, parts[i][j] slots each
            rids, steps, events, counts, call_of = _expand_binds(calls)
            values = _to_numpy(tensors)
        elif size is None and not takes:  # NOTE: a slot allocator's frees: bytes each added, slots in runs
            mine = [t for t in tails if t[0][0] is allocator]
            counts = np.fromiter(tensors, np.int64, len(tensors)) // mine[0][0][4]
            values = np.concatenate([slots for _, slots in mine])
            if len(values) != counts.sum():  # NOTE: a free the runs missed: the ledger must not name wrong slots
                raise RuntimeError(f"mamba frees gave back {int(counts.sum())} slots, their runs hold {len(values)}")
        else:
            counts = np.fromiter(map(type(tensors[0]).numel, tensors), np.int64, len(tensors))
            values = _to_numpy(tensors)
        pages, segs = fold_pages(values, counts, page_size, dedup=takes)
        if size is None:
            pool = "mamba"
            ledgers = (self.takers if takes else self.releasers)[pool]
            ledger = ledgers.get(id(allocator))
            if ledger is None:
                ledger = ledgers[id(allocator)] = Ledger()
        else:
            pool = self.pool_of(allocator)
            ledger = (self.takers if takes else self.releasers)[pool]
        ledger.write(pages, segs, rids, steps, events)
        at = segs if call_of is None else call_of[segs]
        if where is not None:
            at = where[at] if call_of is None else np.where(at >= 0, where[at], -1)
        return Folded(pages, at, page_size, pool, where)


def _work(ledger_of: Callable[[], PageLedger | None], wake: threading.Event) -> None:
    """A ledger's worker thread: folds each time it is woken, until its ledger is gone."""
    while True:
        woken = wake.wait(WORKER_POLL_S)
        ledger = ledger_of()
        if ledger is None:
            return
        if woken:
            wake.clear()  # NOTE: before the fold: a batch taken meanwhile sets it again
            ledger.fold_woken()
        del ledger  # NOTE: not held while waiting: the ledger can end


class Folded(NamedTuple):
    """One fold group's pages (in its calls' order) and, per page, the fold's call it came from
    (-1: a bind's); its allocator's page size and pool; its calls (None: the whole fold)."""

    pages: np.ndarray
    calls: np.ndarray
    page_size: int
    pool: str
    where: np.ndarray | None


def _expand_binds(
    calls: Calls, known: np.ndarray | None = None
) -> tuple[list[Any], list[int], list[str], np.ndarray, np.ndarray]:
    """A group's entries with each bind as one entry per request (`parts[i]` slots each): rids,
    steps, events, slot counts, and each entry's call in the group (-1: a bind's request). `known`:
    each call's slot count, where not every call is a tensor."""
    rids, steps, events = list(calls.rids), list(calls.steps), list(calls.events)
    counts = [t.numel() for t in calls.tensors] if known is None else known.tolist()
    call_of = list(range(len(calls.kinds)))
    for i in reversed([i for i, kind in enumerate(calls.kinds) if kind == BIND]):
        many = len(rids[i])
        rids[i : i + 1] = rids[i]
        steps[i : i + 1] = [steps[i]] * many
        events[i : i + 1] = [events[i]] * many
        counts[i : i + 1] = calls.parts[i]
        call_of[i : i + 1] = [-1] * many
    return rids, steps, events, np.asarray(counts, np.int64), np.asarray(call_of, np.int64)


def event_block(
    kinds: tuple[int, ...],
    rids: tuple[Any, ...],
    steps: tuple[int, ...],
    folded: list[Folded],
    times: dict[int, float],
    now: float,
    binds: bool,
) -> tuple[Any, ...] | None:
    """The fold's alloc / free events, one per allocator call in call order (binds have none), as
    an event block's columns (kvscope.telemetry.remote.RemoteRecorder.event_block): slots = the
    call's pages, num_tokens = pages x page size, pool = its allocator's, t_mono = its step's clock
    read (`times`, else `now`). None: no event."""
    n = len(kinds)
    names: tuple[str, ...]
    if len(folded) == 1:
        group = folded[0]
        calls, pages, names = group.calls, group.pages, (group.pool,)
        pools = bytes(n)
        page_size: Any = group.page_size
    else:
        names = tuple(dict.fromkeys(g.pool for g in folded))
        code = np.zeros(n, np.int8)
        page_size = np.zeros(n, np.int64)
        for g in folded:
            code[g.where] = names.index(g.pool)
            page_size[g.where] = g.page_size
        calls = np.concatenate([g.calls for g in folded])
        order = np.argsort(calls, kind="stable")  # NOTE: each group's pages in call order: merged
        calls, pages = calls[order], np.concatenate([g.pages for g in folded])[order]
        pools = code.tobytes()
    if binds:
        mine = calls >= 0
        calls, pages = calls[mine], pages[mine]
    counts = np.bincount(calls, minlength=n)
    if binds:
        keep = np.frombuffer(bytes(kinds), np.int8) != BIND
        if not keep.any():
            return None
        counts, kinds = counts[keep], tuple(compress(kinds, keep))
        rids, steps = tuple(compress(rids, keep)), tuple(compress(steps, keep))
        pools = np.frombuffer(pools, np.int8)[keep].tobytes()
        if not isinstance(page_size, int):
            page_size = page_size[keep]
    return (
        times,
        now,
        steps,
        bytes(kinds),
        KIND_NAMES,
        pools,
        names,
        rids,
        (counts * page_size).tobytes(),
        counts.tobytes(),
        pages.astype(np.int64, copy=False).tobytes(),
    )


def fold_pages(values: np.ndarray, counts: np.ndarray, page_size: int, *, dedup: bool) -> tuple[np.ndarray, np.ndarray]:
    """(pages, segs) of recorded index tensors laid end to end (`counts[i]` values from call i):
    segs[j] = the call pages[j] came from, ascending. `dedup` (allocs and binds: token slots): slot 0
    (SGLang's padding slot; no SWA peer in a mapped bind) and negative ones (no slot) dropped, and
    each call's distinct pages, ascending; else (frees: page ids) the values as given."""
    segs = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if not dedup:
        return values, segs
    keep = values > 0
    if not keep.all():  # NOTE: slot 0, and -1 (a Mamba bind's empty track slot)
        values, segs = values[keep], segs[keep]
    if page_size == 1 or not len(values):
        return values, segs
    shift = page_size.bit_length() - 1
    pages = values >> shift if page_size == 1 << shift else values // page_size
    first = np.empty(len(pages), bool)  # NOTE: a call's slots come page by page: drop the repeats in a run
    first[0] = True
    np.not_equal(pages[1:], pages[:-1], out=first[1:])
    first[1:] |= segs[1:] != segs[:-1]
    pages, segs = pages[first], segs[first]
    if ((pages[1:] <= pages[:-1]) & (segs[1:] == segs[:-1])).any():  # NOTE: a call not in ascending pages
        stride = int(pages.max()) + 1
        keys = np.unique(segs * stride + pages)
        return keys % stride, keys // stride
    return pages, segs


def mixed_pages(
    values: np.ndarray, counts: np.ndarray, frees: np.ndarray, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fold_pages over takes and frees laid end to end in call order (`frees[i]`: entry i is a
    free): (pages, segs, freed) with each take's pages as fold_pages(dedup=True) gives them and
    each free's as given, entries in order; freed[j]: pages[j] is a free's."""
    segs = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    freed = np.repeat(frees, counts)
    keep = freed | (values > 0)
    if not keep.all():  # NOTE: a take's slot 0 and -1
        values, segs, freed = values[keep], segs[keep], freed[keep]
    if page_size == 1 or not len(values):
        return values, segs, freed
    shift = page_size.bit_length() - 1
    pages = values >> shift if page_size == 1 << shift else values // page_size
    pages[freed] = values[freed]  # NOTE: a free's values are page ids already
    first = freed.copy()  # NOTE: a take's slots come page by page: drop the repeats in a run
    first[0] = True
    first[1:] |= (pages[1:] != pages[:-1]) | (segs[1:] != segs[:-1])
    pages, segs, freed = pages[first], segs[first], freed[first]
    same = segs[1:] == segs[:-1]  # NOTE: pairs in one entry: both a take's or both a free's
    if not ((pages[1:] <= pages[:-1]) & same & ~freed[1:]).any():
        return pages, segs, freed
    taken = ~freed  # NOTE: a take not in ascending pages: its distinct pages, sorted, as fold_pages
    stride = int(pages.max()) + 1
    keys = np.unique(segs[taken] * stride + pages[taken])
    segs = np.concatenate((keys // stride, segs[freed]))
    order = np.argsort(segs, kind="stable")  # NOTE: back in entry order (a take's pages before no free's)
    pages = np.concatenate((keys % stride, pages[freed]))[order]
    freed = np.concatenate((np.zeros(len(keys), bool), np.ones(len(segs) - len(keys), bool)))[order]
    return pages, segs[order], freed


def _to_numpy(tensors: tuple[Any, ...]) -> np.ndarray:
    """Index tensors laid end to end as one int64 array: one concatenation where they are, one
    transfer off the device (torch is the engine's, loaded since it made these tensors; the probe
    never imports it)."""
    joined = tensors[0] if len(tensors) == 1 else sys.modules["torch"].cat(tensors)
    return joined.cpu().numpy().reshape(-1).astype(np.int64, copy=False)


def _gather(table: Any, starts: list[int], parts: list[int]) -> Any:
    """The slots [starts[i], starts[i] + parts[i]) of the flattened table, run after run, copied
    into one new int64 tensor on the table's device (one index transfer, one gather)."""
    counts = np.asarray(parts, np.int64)
    offsets = np.repeat(np.asarray(starts, np.int64) - (np.cumsum(counts) - counts), counts)
    offsets += np.arange(len(offsets), dtype=np.int64)
    index = table.new_empty(0).long().new_tensor(offsets)
    return table.reshape(-1)[index].long()


def chain_takes(
    tensors: tuple[Any, ...], parts: tuple[Any, ...], tails: list[tuple[list[Any], np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """A slot allocator's takes, some queued as tensors (a slice, a bind's slots) and some by their
    place in the ledger's count of pops (the place in tensors, the count in parts): their slots laid
    end to end in call order, and each call's count. `tails`: this allocator's runs and their slots
    (run_tails). A pop belongs to the last chain that began at or before its place; a chain's slots
    in FIFO order are the free_slots it began with, then what its runs hold. Per call only C-level
    passes."""
    n = len(tensors)
    flags = list(map(operator.is_, map(type, tensors), repeat(int, n)))
    placed = np.array(flags, bool)
    at = np.fromiter(compress(tensors, flags), np.int64)
    need = np.fromiter(compress(parts, flags), np.int64)
    chains = list({id(run[5]): run[5] for run, _ in tails}.values())  # NOTE: in order, by identity (two can be equal)
    fifo = [np.concatenate((_to_numpy((c[0],)), *(slots for run, slots in tails if run[5] is c))) for c in chains]
    begins = np.fromiter((c[1] for c in chains), np.int64, len(chains))
    offsets = np.cumsum([0, *map(len, fifo)])[:-1]
    chain = np.searchsorted(begins, at, "right") - 1  # NOTE: the last chain that began at or before the pop
    starts = np.cumsum(need) - need  # NOTE: where each pop's slots begin in the result
    index = np.repeat(offsets[chain] + at - begins[chain] - starts, need) + np.arange(int(need.sum()))
    by_place = np.concatenate(fifo)[index]
    counts = np.empty(n, np.int64)
    counts[placed] = need
    if placed.all():
        return by_place, counts
    rest = tuple(compress(tensors, map(operator.not_, flags)))
    counts[~placed] = np.fromiter(map(type(rest[0]).numel, rest), np.int64, len(rest))
    values = np.empty(int(counts.sum()), np.int64)
    mask = np.repeat(placed, counts)
    values[mask], values[~mask] = by_place, _to_numpy(rest)
    return values, counts


def run_tails(runs: list[list[Any]]) -> list[tuple[list[Any], np.ndarray]]:
    """Each slot run (PageLedger.slot_runs) with the slots its frees gave back, in call order: the
    tail of its free_slots. One concatenation and one transfer for all runs of a fold; both a slot
    allocator's frees and its pops' places (chain_takes) read them."""
    if not runs:
        return []
    held = [run[2] // run[4] for run in runs]
    parts = tuple(run[1][run[3] // run[4] - n :] for run, n in zip(runs, held, strict=True) if n)
    values = _to_numpy(parts) if parts else np.zeros(0, np.int64)
    return list(zip(runs, np.split(values, np.cumsum(held)[:-1]), strict=True))
