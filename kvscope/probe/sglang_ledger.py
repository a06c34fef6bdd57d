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
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import compress
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from kvscope.telemetry import EventKind

KIND_NAMES = (EventKind.ALLOC._value_, EventKind.FREE._value_)  # NOTE: an event block's kinds, by ALLOC / FREE
ALLOC, FREE, BIND = 0, 1, 2  # NOTE: what a pending entry records
FOLD_CALLS = 256  # NOTE: pending entries that fold at the next step (else every FOLD_INTERVAL_S, and at a census)
FOLD_INTERVAL_S = 0.2  # NOTE: as the recorder's hand-off: a step's events wait at most this long
_monotonic = time.monotonic
Entry = tuple[str | None, int, str]  # NOTE: (rid, step, event), as sglang_census
Pending = tuple[int, Any, Any, int, str, Any, Any]  # NOTE: (ALLOC/FREE/BIND, allocator, rid or a bind's rids,
# step, event, index tensor, None or a bind's slots per request)


class Calls(NamedTuple):
    """A fold's (or one fold group's) recorded calls, as columns (the Pending fields)."""

    kinds: tuple[int, ...]
    allocators: tuple[Any, ...]
    rids: tuple[Any, ...]
    steps: tuple[int, ...]
    events: tuple[str, ...]
    tensors: tuple[Any, ...]
    parts: tuple[Any, ...]


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

    def drain(self, step: int, emit: Callable[[tuple[Any, ...]], None] | None) -> float | None:
        """Fold the allocator calls and binds recorded since the last fold into the ledger, in
        order, and (level full) their alloc / free events in call order as one event block (`emit`:
        the recorder's event_block; None at level summary): per allocator and ledger one
        concatenation, one transfer off the device and a few numpy passes; per call only C-level
        passes over the recorded columns, no Python object per call. `step`: the step now (its
        clock read stays). The fold's clock read, None when nothing was pending."""
        if not self.pending:
            return None
        pending = self.pending.copy()  # NOTE: emptied in place: the probe's hooks hold this list
        self.pending.clear()
        self.folded_at = now = _monotonic()
        n = len(pending)
        columns = Calls(*zip(*pending, strict=True))
        kinds, allocators = columns.kinds, columns.allocators
        binds = BIND in kinds
        frees = FREE in kinds
        folded: list[Folded] = []
        if allocators.count(allocators[0]) == n and (not frees or kinds.count(FREE) == n):  # NOTE: one group
            folded.append(self.fold_group(allocators[0], not frees, None, columns, binds))
        else:
            takes = np.frombuffer(bytes(kinds), np.int8) != FREE
            groups = np.fromiter(map(id, allocators), np.int64, n) * 2 + takes
            for group in np.unique(groups).tolist():
                where = np.flatnonzero(groups == group)
                pick = _picker(where.tolist())
                calls = Calls(*map(pick, columns))
                folded.append(self.fold_group(calls.allocators[0], bool(takes[where[0]]), where, calls, binds))
        if emit is not None:
            block = event_block(kinds, columns.rids, columns.steps, folded, self.step_now, now, binds)
            if block is not None:
                emit(block)
        self.step_now = {step: self.step_now.get(step, now)}
        return now

    def fold_group(self, allocator: Any, takes: bool, where: np.ndarray | None, calls: Calls, binds: bool) -> Folded:
        """One allocator's takes (allocs and binds) or frees (the fold's calls at `where`, None: all)
        into its ledger; its pages and the fold's call each came from (-1: a bind's: no event)."""
        page_size = int(allocator.page_size)
        tensors = calls.tensors
        rids: Sequence[Any] = calls.rids
        steps: Sequence[int] = calls.steps
        events: Sequence[str] = calls.events
        call_of: np.ndarray | None = None
        if binds and BIND in calls.kinds:  # NOTE: a bind: one entry per request, parts[i][j] slots each
            rids, steps, events, counts, call_of = _expand_binds(calls)
        else:
            counts = np.fromiter(map(type(tensors[0]).numel, tensors), np.int64, len(tensors))
        pages, segs = fold_pages(_to_numpy(tensors), counts, page_size, dedup=takes)
        pool = self.pool_of(allocator)
        (self.takers if takes else self.releasers)[pool].write(pages, segs, rids, steps, events)
        at = segs if call_of is None else call_of[segs]
        if where is not None:
            at = where[at] if call_of is None else np.where(at >= 0, where[at], -1)
        return Folded(pages, at, page_size, pool, where)


class Folded(NamedTuple):
    """One fold group's pages (in its calls' order) and, per page, the fold's call it came from
    (-1: a bind's); its allocator's page size and pool; its calls (None: the whole fold)."""

    pages: np.ndarray
    calls: np.ndarray
    page_size: int
    pool: str
    where: np.ndarray | None


def _expand_binds(calls: Calls) -> tuple[list[Any], list[int], list[str], np.ndarray, np.ndarray]:
    """A group's entries with each bind as one entry per request (`parts[i]` slots each): rids,
    steps, events, slot counts, and each entry's call in the group (-1: a bind's request)."""
    rids, steps, events = list(calls.rids), list(calls.steps), list(calls.events)
    counts = [t.numel() for t in calls.tensors]
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
    (SGLang's padding slot; no SWA peer in a mapped bind) dropped, and each call's distinct pages,
    ascending; else (frees: page ids) the values as given."""
    segs = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if not dedup:
        return values, segs
    if np.count_nonzero(values) != len(values):
        keep = values > 0
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


MambaCall = tuple[int, Any, Any, int, str, float, Any, int]  # NOTE: (ALLOC/FREE/BIND, MambaSlotAllocator, rid or a
# bind's rids, step, event, the step's clock read, slot tensor, a bind's slots per request)


def mamba_parts(calls: list[MambaCall]) -> tuple[tuple[Any, ...], list[tuple[int, int, int]]]:
    """The tensors fold_mamba concatenates, and each call's (part, offset, count) in them (count -1:
    the whole part). An alloc or a bind is its own part. A free kept SGLang's free_slots before and
    after it (_d_mamba_free): its slots are the tail the cat added. Frees of one allocator whose
    free_slots chain (each one's before ends where the previous one's after ends, by address: that
    after or a slice of it, allocs only drop its head; clear() starts a new tensor and a new chain)
    keep their freed slots in the tails of the later afters: one slice per run of frees a later
    after still holds (_chain_parts), not one per free (a tensor slice costs about as much as a
    copy)."""
    parts: list[Any] = []
    spans: list[tuple[int, int, int]] = []
    chains: dict[int, list[Any]] = {}  # NOTE: id(allocator) -> [the last after's end address, total,
    # [(call, offset, count, after)], item size]
    every: list[list[Any]] = []
    for i, call in enumerate(calls):
        kept = call[6]
        if type(kept) is not tuple:
            spans.append((len(parts), 0, -1))
            parts.append(kept)
            continue
        spans.append((0, 0, 0))
        before, after = kept
        kept_before, kept_after = before.numel(), after.numel()
        chain = chains.get(id(call[1]))
        if chain is None or before.data_ptr() + kept_before * chain[3] != chain[0]:  # NOTE: not the last after's tail
            chain = chains[id(call[1])] = [0, 0, [], after.element_size()]
            every.append(chain)
        count = kept_after - kept_before
        chain[2].append((i, chain[1], count, after))
        chain[0] = after.data_ptr() + kept_after * chain[3]  # NOTE: where the after ends (it is kept alive)
        chain[1] += count
    for _, _, members, _ in every:
        _chain_parts(members, parts, spans)
    return tuple(parts), spans


def _chain_parts(members: list[tuple[int, int, int, Any]], parts: list[Any], spans: list[tuple[int, int, int]]) -> None:
    """One slice per after that still holds a run of the chain's frees, latest first: an after
    holds the chain's slots freed up to its own free, as far back as its length (allocs take
    slots from the head, so the pool's allocs since a free eventually reach what it freed)."""
    runs: list[list[Any]] = []  # NOTE: [after, end, first offset, [(call, offset, count)], the after's length]
    for i, offset, count, after in reversed(members):
        if not runs or offset < runs[-1][1] - runs[-1][4]:
            runs.append([after, offset + count, offset, [], after.numel()])
        run = runs[-1]
        run[2] = offset
        run[3].append((i, offset, count))
    for after, end, first, held, size in runs:
        part = len(parts)
        parts.append(after[size - (end - first) :])
        for i, offset, count in held:
            spans[i] = (part, offset - first, count)


def numel(tensor: Any) -> int:
    return int(tensor.numel())  # NOTE: a tensor's len() costs about 7 times as much
