"""The SGLang probe's page ledger: whom each page was last taken by and released for, kept in bulk.

The allocator hooks and the bind only queue their index tensors (`PageLedger.pending`, no read per
call); a fold takes the queue in call order into the ledgers (a numpy array per pool, page -> entry
id) and, at level full, emits one alloc / free event per allocator call. The probe folds every
FOLD_INTERVAL_S or FOLD_CALLS entries, at each census and at exit. Imports: stdlib and numpy (torch
is the engine's, found in sys.modules, never imported here).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain, repeat
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from kvscope.telemetry import EventKind

ALLOC_V, FREE_V = EventKind.ALLOC._value_, EventKind.FREE._value_
ALLOC, FREE, BIND = 0, 1, 2  # NOTE: what a pending entry records
FOLD_CALLS = 256  # NOTE: pending entries that fold at the next step (else every FOLD_INTERVAL_S, and at a census)
FOLD_INTERVAL_S = 0.2  # NOTE: as the recorder's hand-off: a step's events wait at most this long
_monotonic = time.monotonic
Entry = tuple[str | None, int, str]  # NOTE: (rid, step, event), as sglang_census
Pending = tuple[int, Any, Any, int, str, Any, Any]  # NOTE: (ALLOC/FREE/BIND, allocator, rid or a bind's rids,
# step, event, index tensor, None or a bind's slots per request)


class Calls(NamedTuple):
    """One fold group's recorded calls, as columns (the Pending fields less the allocator)."""

    kinds: tuple[int, ...]
    rids: tuple[Any, ...]
    steps: tuple[int, ...]
    events: tuple[str, ...]
    tensors: tuple[Any, ...]
    parts: tuple[Any, ...]


class Described:
    """A fold's alloc / free events, per call in call order: pool, tokens and pages (object columns)."""

    def __init__(self, num_calls: int) -> None:
        self.pools = np.empty(num_calls, object)
        self.sizes = np.zeros(num_calls, np.int64)
        self.slots = np.empty(num_calls, object)


def _picker(where: list[int]) -> Callable[[Any], tuple[Any, ...]]:
    """The items at `where` of a column, as a tuple (itemgetter, which gives no tuple for one)."""
    if len(where) == 1:
        at = where[0]
        return lambda column: (column[at],)
    return itemgetter(*where)


class Ledger(Mapping[int, Entry]):
    """page -> the last (rid, step, event) written for it: an entry id per page in a numpy array
    (-1: none), the entries in a list (compacted when it outgrows the pages)."""

    def __init__(self) -> None:
        self.ids = np.full(0, -1, np.int64)
        self.entries: list[Entry] = []

    def write(self, pages: np.ndarray, segs: np.ndarray, entries: list[Entry]) -> None:
        """pages[j] was written by entries[segs[j]]; segs ascending (in call order): a later write wins."""
        if not len(pages):
            return
        top = int(pages.max()) + 1
        if top > len(self.ids):
            grown = np.full(max(top, 2 * len(self.ids)), -1, np.int64)
            grown[: len(self.ids)] = self.ids
            self.ids = grown
        order = np.argsort(pages, kind="stable")
        pages, segs = pages[order], segs[order]
        last = np.ones(len(pages), bool)
        np.not_equal(pages[1:], pages[:-1], out=last[:-1])
        self.ids[pages[last]] = segs[last] + len(self.entries)
        self.entries.extend(entries)
        if len(self.entries) > 2 * len(self.ids) + 1024:
            self.compact()

    def compact(self) -> None:
        held = self.ids >= 0
        kept, self.ids[held] = np.unique(self.ids[held], return_inverse=True)
        self.entries = [self.entries[i] for i in kept.tolist()]

    def __getitem__(self, page: int) -> Entry:
        i = int(self.ids[page]) if 0 <= page < len(self.ids) else -1
        if i < 0:
            raise KeyError(page)
        return self.entries[i]

    def __contains__(self, page: object) -> bool:
        return isinstance(page, int) and 0 <= page < len(self.ids) and self.ids[page] >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self.ids >= 0).tolist())

    def __len__(self) -> int:
        return int(np.count_nonzero(self.ids >= 0))


class PageLedger:
    """The queue of allocator calls and binds not yet folded, and the ledgers they fold into: per
    pool (full, swa; req rows are a dict the row hooks write at once) the last taker and releaser of
    each page."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []  # NOTE: allocator calls and binds not yet folded, in order
        self.takers: dict[str, Any] = {"full": Ledger(), "swa": Ledger(), "req": {}}  # NOTE: req rows: a dict
        self.releasers: dict[str, Any] = {"full": Ledger(), "swa": Ledger(), "req": {}}
        self.pools: dict[int, str] = {}  # id(sub-allocator) -> "swa" (anything else is full)
        self.folded_at = _monotonic()
        self.step_now: dict[int, float] = {}  # NOTE: step -> its clock read (the t_mono of its folded events)

    def due(self, now: float) -> bool:
        """A fold every FOLD_CALLS entries or FOLD_INTERVAL_S (the probe asks once per step)."""
        return len(self.pending) >= FOLD_CALLS or now - self.folded_at >= FOLD_INTERVAL_S

    def pool_of(self, allocator: Any) -> str:
        return self.pools.get(id(allocator), "full")

    def drain(self, step: int, emit: Callable[[Iterable[Any]], None] | None) -> float | None:
        """Fold the allocator calls and binds recorded since the last fold into the ledger, in
        order, and (level full) their alloc / free events in call order: per allocator and ledger
        one concatenation, one transfer off the device and a few numpy passes (fold_pages), no
        tensor read per call; per call only C-level passes over the recorded columns. `step`: the
        step now (its clock read stays); `emit`: the recorder's item sink, None at level summary.
        The fold's clock read, None when nothing was pending."""
        if not self.pending:
            return None
        pending = self.pending.copy()  # NOTE: emptied in place: the probe's hooks hold this list
        self.pending.clear()
        self.folded_at = now = _monotonic()
        n = len(pending)
        kinds, allocators, rids, steps, events, tensors, parts = zip(*pending, strict=True)
        kind = np.fromiter(kinds, np.int8, n)
        takes = kind != FREE
        single = allocators.count(allocators[0]) == n  # NOTE: identity first: no hash needed
        groups = takes.view(np.int8) if single else np.fromiter(map(id, allocators), np.int64, n) * 2 + takes
        binds = BIND in kinds
        described = Described(n) if emit is not None else None
        for group in np.unique(groups).tolist():
            where = np.flatnonzero(groups == group)
            if len(where) == n:
                calls = Calls(kinds, rids, steps, events, tensors, parts)
            else:
                pick = _picker(where.tolist())
                calls = Calls(pick(kinds), pick(rids), pick(steps), pick(events), pick(tensors), pick(parts))
            self.fold_group(allocators[where[0]], bool(takes[where[0]]), calls, binds, where, described)
        if emit is not None and described is not None:
            self.emit_events(emit, kind, rids, steps, described, now)
        self.step_now = {step: self.step_now.get(step, now)}
        return now

    def fold_group(
        self, allocator: Any, takes: bool, calls: Calls, binds: bool, where: np.ndarray, described: Described | None
    ) -> None:
        """One allocator's takes (allocs and binds) or frees into its ledger; each alloc / free
        call's pool, tokens and pages into `described` at its place in the fold (`where`)."""
        page_size = int(allocator.page_size)
        entries = list(zip(calls.rids, calls.steps, calls.events, strict=True))
        counts = list(map(type(calls.tensors[0]).numel, calls.tensors))
        is_call = None
        if binds and BIND in calls.kinds:  # NOTE: a bind: one entry per request, parts[i][j] slots each
            is_call = [p is None for p in calls.parts for _ in (p or (None,))]
            for i in reversed([i for i, kind in enumerate(calls.kinds) if kind == BIND]):
                rid, step, event = entries[i]
                entries[i : i + 1] = [(r, step, event) for r in rid]
                counts[i : i + 1] = calls.parts[i]
        pages, segs = fold_pages(_to_numpy(calls.tensors), np.asarray(counts, np.int64), page_size, dedup=takes)
        pool = self.pool_of(allocator)
        (self.takers if takes else self.releasers)[pool].write(pages, segs, entries)
        if described is None:
            return
        bounds = np.searchsorted(segs, np.arange(len(entries) + 1))
        lo, hi = bounds[:-1], bounds[1:]
        if is_call is not None:  # NOTE: a bind's requests take no event
            mask = np.array(is_call, bool)
            lo, hi, where = lo[mask], hi[mask], where[np.array([p is None for p in calls.parts], bool)]
        listed = pages.tolist()
        pieces = map(listed.__getitem__, map(slice, lo.tolist(), hi.tolist()))  # NOTE: lists: marshal carries them
        described.pools[where] = pool
        described.sizes[where] = (hi - lo) * page_size
        described.slots[where] = np.fromiter(pieces, object, len(lo))

    def emit_events(
        self,
        emit: Callable[[Iterable[Any]], None],
        kind: np.ndarray,
        rids: Any,
        steps: Any,
        described: Described,
        now: float,
    ) -> None:
        """One alloc or free event per allocator call, in call order (binds have none), with its
        step's clock read."""
        values = np.full(len(kind), FREE_V, object)
        values[kind == ALLOC] = ALLOC_V
        pools, sizes, slots = described.pools, described.sizes, described.slots
        if (kind == BIND).any():
            kept = np.flatnonzero(kind != BIND)
            if not len(kept):
                return
            pick = _picker(kept.tolist())
            rids, steps = pick(rids), pick(steps)
            values, pools, sizes, slots = values[kept], pools[kept], sizes[kept], slots[kept]
        times = map(self.step_now.get, steps, repeat(now))
        nones = repeat(None)
        emit(
            chain.from_iterable(
                zip(steps, times, values, pools, rids, nones, sizes.tolist(), repeat(0), nones, nones, slots)
            )
        )


def fold_pages(values: np.ndarray, counts: np.ndarray, page_size: int, *, dedup: bool) -> tuple[np.ndarray, np.ndarray]:
    """(pages, segs) of recorded index tensors laid end to end (`counts[i]` values from call i):
    segs[j] = the call pages[j] came from, ascending. `dedup` (allocs and binds: token slots): slot 0
    (SGLang's padding slot; no SWA peer in a mapped bind) dropped, and each call's distinct pages,
    ascending; else (frees: page ids) the values as given."""
    segs = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if not dedup:
        return values, segs
    if not values.all():
        keep = values > 0
        values, segs = values[keep], segs[keep]
    if page_size == 1 or not len(values):
        return values, segs
    pages = values // page_size
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
