"""What a chunk carries to a read at one step (schema version 11): its evictions per step, and its
net change to the locks held. A read at step S adds up the carries of the chunks wholly at or
before S and computes the same from the events of the few chunks that straddle S, so the
Evictions page's chart and the Radix tree page's lock holders read one small value per chunk, not
every evict, lock and unlock of a 100 M-event run.

NOTE: the two carries
    evict_steps   per step with an evict event in the chunk, in step order: the step, its
                  evictions, their tokens and the first one's t_mono (EVICT_STEP_DTYPE records,
                  little-endian bytes; b"": none). Every event of a step lands in one bucket of
                  evictions_over_steps, so these sum to the same buckets as the events.
    lock_carry    LOCK_CARRY_DTYPE records (node, holder, seq, step) of the chunk's changes to the
                  locks held for later steps: first a release record (seq RELEASE) per unlock that
                  found none of the chunk's own locks held on its node for its holder (it releases
                  the latest lock held before the chunk, if any), then the chunk's locks still held
                  at its end, in seq order. A holder is a rid's code (NO_CODE: none) or a host-tier
                  copy's -2 - (2 * aux + 0 for write, 1 for load) (held_locks' lock_holder names it
                  "write|load <aux>"; an op id is never negative). Per (node, holder) the locks
                  form a stack (an unlock releases the latest lock, and one with none held releases
                  nothing), and a stack's changes compose: pop the releases (at most its height),
                  push the rest. So the locks held after a step are the chunks' records replayed in
                  seq order, exactly what replaying every lock and unlock up to it gives.
    request_carry the number of open records (8 bytes), then per request whose latest match or end
                  (finish, abort, retract) in the chunk is a match, an open record (rid code, seq,
                  step, hit tokens: REQUEST_OPEN_DTYPE), then the rids (int32 codes) of those whose
                  latest is an end. A request runs after a step iff its latest such event by then is
                  a match: its latest record over the chunks is an open one.
    miss_nodes    (schema version 13) the distinct nodes, ascending ("<i8"), at which the chunk's
                  match events stopped having missed tokens (aux > 0): the eviction log's regret looks
                  for the first such match at a node after its eviction, and reads only the chunks
                  that name it (b"": none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvscope.telemetry.events import EventKind

NO_CODE = -1  # NOTE: packed.NO_CODE (packed imports this module)
NULL_INT = np.iinfo(np.int64).min  # NOTE: packed.NULL_INT
EVICT_STEP_DTYPE = np.dtype([("step", "<i8"), ("evictions", "<i8"), ("tokens", "<i8"), ("t_mono", "<f8")])
LOCK_CARRY_DTYPE = np.dtype([("node", "<i8"), ("holder", "<i8"), ("seq", "<i8"), ("step", "<i8")])
CARRY_FIELDS = ("kind", "step", "t_mono", "num_tokens", "node_id", "rid", "reason", "aux")  # NOTE: what carries read
MISS_FIELDS = ("kind", "node_id", "aux")  # NOTE: what miss_nodes reads
COPY_REASONS = ("write", "load")  # NOTE: a lock without a rid for one of these is a host-tier copy's


def carries(
    columns: Mapping[str, np.ndarray], first_seq: int, code_of: Callable[[str], int | None]
) -> tuple[bytes, bytes, bytes, bytes]:
    """A chunk's (evict_steps, lock_carry, request_carry, miss_nodes) from its CARRY_FIELDS columns
    (strings as codes, node_id with NULL_INT; `code_of`: a string's code, None when the run has none)."""
    kind = np.asarray(columns["kind"])
    evicts = evict_steps(columns, kind == _code(code_of, EventKind.EVICT.value))
    misses = miss_nodes(columns, kind == _code(code_of, EventKind.MATCH.value))
    return evicts, lock_carry(columns, first_seq, code_of), request_carry(columns, first_seq, code_of), misses


def miss_nodes(columns: Mapping[str, np.ndarray], is_match: np.ndarray) -> bytes:
    """The distinct nodes of the masked (match) events that missed tokens, ascending, as "<i8" bytes."""
    node = np.asarray(columns["node_id"]).astype(np.int64)
    missed = is_match & (np.asarray(columns["aux"]) > 0) & (node != NULL_INT)
    return np.unique(node[missed]).astype("<i8").tobytes()


def read_miss_nodes(data: bytes) -> np.ndarray:
    if len(data) % 8:
        raise ValueError(f"{len(data)} bytes are not whole node ids")
    return np.frombuffer(data, "<i8")


def _code(code_of: Callable[[str], int | None], text: str) -> int:
    found = code_of(text)
    return -2 if found is None else int(found)  # NOTE: -2 matches no stored code


def evict_steps(columns: Mapping[str, np.ndarray], is_evict: np.ndarray) -> bytes:
    """EVICT_STEP_DTYPE records of the masked events, one per step."""
    if not is_evict.any():
        return b""
    step = np.asarray(columns["step"])[is_evict].astype(np.int64)
    order = np.argsort(step, kind="stable")
    step = step[order]
    starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
    out = np.empty(len(starts), EVICT_STEP_DTYPE)
    out["step"] = step[starts]
    out["evictions"] = np.diff(np.r_[starts, len(step)])
    out["tokens"] = np.add.reduceat(np.asarray(columns["num_tokens"])[is_evict].astype(np.int64)[order], starts)
    out["t_mono"] = np.minimum.reduceat(np.asarray(columns["t_mono"])[is_evict].astype(np.float64)[order], starts)
    return out.tobytes()


def read_evict_steps(data: bytes) -> np.ndarray:
    if len(data) % EVICT_STEP_DTYPE.itemsize:
        raise ValueError(f"{len(data)} bytes are not whole evict-step records")
    return np.frombuffer(data, EVICT_STEP_DTYPE)


def lock_carry(columns: Mapping[str, np.ndarray], first_seq: int, code_of: Callable[[str], int | None]) -> bytes:
    """The lock_carry records of a chunk's events (in seq order; the first has seq `first_seq`, or
    `columns` has a "seq" column: some events of one chunk, or of the row layout)."""
    kind = np.asarray(columns["kind"])
    node = np.asarray(columns["node_id"]).astype(np.int64)
    is_lock = kind == _code(code_of, EventKind.LOCK.value)
    mask = (is_lock | (kind == _code(code_of, EventKind.UNLOCK.value))) & (node != NULL_INT)
    if not mask.any():
        return b""
    seqs = np.asarray(columns["seq"]) if "seq" in columns else first_seq + np.arange(len(kind))
    holder = _holders(columns, mask, code_of)
    node = node[mask]
    group, order = _pair_groups(node, holder)
    released, held = _stacks(group, order, np.where(is_lock[mask], 1, -1))
    # NOTE: a release row per unlock that found the chunk's stack empty (each group's first such unlock
    # stands for them), then the locks still held, in seq order
    first_of = np.unique(group, return_index=True)[1]
    times = released[group[first_of]]
    out = np.concatenate(
        [
            _records(np.repeat(node[first_of], times), np.repeat(holder[first_of], times), RELEASE, 0),
            _records(node[held], holder[held], seqs[mask][held], np.asarray(columns["step"])[mask][held]),
        ]
    )
    return out.tobytes()


RELEASE = -1  # NOTE: the seq of a release record


def _records(node: np.ndarray, holder: np.ndarray, seq: Any, step: Any) -> np.ndarray:
    out = np.empty(len(node), LOCK_CARRY_DTYPE)
    out["node"], out["holder"], out["seq"], out["step"] = node, holder, seq, step
    return out


def _holders(columns: Mapping[str, np.ndarray], mask: np.ndarray, code_of: Callable[[str], int | None]) -> np.ndarray:
    """Each masked event's holder as an int: a rid code (NO_CODE: none), or a host-tier copy's
    holder_key (by reason and aux)."""
    rid = np.asarray(columns["rid"])[mask].astype(np.int64)
    reason = np.asarray(columns["reason"])[mask].astype(np.int64)
    aux = np.asarray(columns["aux"])[mask].astype(np.int64)
    for index, text in enumerate(COPY_REASONS):
        copy = (rid == NO_CODE) & (reason == _code(code_of, text))
        rid = np.where(copy, -2 - (2 * aux + index), rid)
    return rid


def holder_names(holders: np.ndarray, decode: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Holders (lock_carry's ints) as names: rid codes decoded, copies as "write|load <aux>"."""
    out = np.empty(len(holders), dtype=object)
    coded = holders >= NO_CODE
    if coded.any():
        out[coded] = decode(holders[coded])
    copies = np.flatnonzero(~coded)
    key = -2 - holders[copies]
    out[copies] = [f"{COPY_REASONS[k % 2]} {k // 2}" for k in key.tolist()]
    return out


def _pair_groups(node: np.ndarray, holder: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A group id per (node, holder) pair, 0.. in pair order, and the order that lists the groups in
    turn, each group's rows in their order (a stable sort by group).

    NOTE: one int64 key per pair where the pairs' span fits (else a lexsort, 3x slower): an unstable
    argsort of the keys numbers the groups, then a sort of group << bits | row (values, not indices:
    numpy sorts those several times faster) gives the stable order. np.unique over rows sorts a
    copy of every row as bytes: 1.6 s for the 630k records of a 100 M-event run."""
    rows = len(node)
    key = _pair_key(node, holder)
    if key is None:
        order = np.lexsort((holder, node))  # NOTE: stable
        n, h = node[order], holder[order]
        starts = np.r_[True, (n[1:] != n[:-1]) | (h[1:] != h[:-1])]
    else:
        order = np.argsort(key)
        k = key[order]
        starts = np.r_[True, k[1:] != k[:-1]]
    group = np.empty(rows, np.int64)
    group[order] = np.cumsum(starts) - 1
    if key is not None:
        order = _stable_order(group)
    return group, order


def _pair_key(node: np.ndarray, holder: np.ndarray) -> np.ndarray | None:
    """(node, holder) as one int64 that sorts as the pair, None when the span would not fit."""
    if not len(node):
        return np.zeros(0, np.int64)
    node_low, holder_low = int(node.min()), int(holder.min())
    holder_span = int(holder.max()) - holder_low + 1
    if (int(node.max()) - node_low + 1) * holder_span >= 2**62:
        return None
    return (node.astype(np.int64) - node_low) * holder_span + (holder.astype(np.int64) - holder_low)


def _stable_order(group: np.ndarray) -> np.ndarray:
    """The rows in group order, each group's in row order (a stable argsort of non-negative ids)."""
    bits = max(len(group) - 1, 1).bit_length()
    if not len(group) or int(group.max()).bit_length() + bits > 62:
        return np.argsort(group, kind="stable")
    return np.sort((group << bits) | np.arange(len(group))) & ((1 << bits) - 1)


def _stacks(group: np.ndarray, order: np.ndarray, change: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group, the releases that found its stack empty, and per event whether it is a lock still
    held at the end (events in order; change +1 lock, -1 unlock; `order`: _pair_groups' stable order
    by group).

    NOTE: per group, in order, the height after each event is the running sum c reflected at 0:
    c - min(0, running min of c); a lock is held iff no later event of its group is lower, and the
    releases that found the stack empty are -min(0, min c). The running minima restart per group by
    moving group g down by g * span (each group then lies below every earlier one)."""
    g, d = group[order], change[order]
    span = 2 * len(d) + 1
    total = np.cumsum(d)
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    before = np.r_[0, total][starts]
    c = total - np.repeat(before, np.diff(np.r_[starts, len(d)]))
    low = np.minimum.accumulate(c - g * span) + g * span
    height = c - np.minimum(low, 0)
    rev = (g.max() - g)[::-1]
    lowest_after = (np.minimum.accumulate(height[::-1] - rev * span) + rev * span)[::-1]
    held = np.zeros(len(d), bool)
    held[order] = (d > 0) & (lowest_after >= height)
    ends = np.r_[starts[1:], len(d)] - 1
    releases = np.zeros(int(group.max()) + 1, np.int64)
    releases[g[ends]] = -np.minimum(low[ends], 0)
    return releases, held


def read_lock_carry(data: bytes) -> np.ndarray:
    if len(data) % LOCK_CARRY_DTYPE.itemsize:
        raise ValueError(f"{len(data)} bytes are not whole lock-carry records")
    return np.frombuffer(data, LOCK_CARRY_DTYPE)


def held_after(carried: Sequence[np.ndarray]) -> np.ndarray:
    """The locks held after the chunks whose lock_carry records are `carried` (in seq order): their
    records of the locks still held, in seq order. NOTE: a chunk's releases come first in its records
    and pop the latest locks held before it; the stacks are replayed at once (_stacks), a block of
    about BLOCK_RECORDS records at a time: a block's records compose into the releases that found its
    stacks empty, then its locks still held (a carry of its own, mostly much shorter), and the
    blocks' carries replay as the records would. A 100 M-event run's 1.3 M records cost half the
    CPU in blocks that stay in the caches."""
    blocks: list[np.ndarray] = []
    pending: list[np.ndarray] = []
    num_pending = 0
    for records in carried:
        pending.append(records)
        num_pending += len(records)
        if num_pending >= BLOCK_RECORDS:
            blocks.append(_composed(_joined(pending, LOCK_CARRY_DTYPE)))
            pending, num_pending = [], 0
    held = _composed(_joined([*blocks, *pending], LOCK_CARRY_DTYPE))
    held = held[held["seq"] != RELEASE]
    return held[np.argsort(held["seq"], kind="stable")]


BLOCK_RECORDS = 16384  # NOTE: fastest of 2k-32k on the 1.3 M records of a 100 M-event run


def _composed(records: np.ndarray) -> np.ndarray:
    """The carry of a run of lock_carry records: a release record per release that found its stack
    empty, then the locks still held, in their order."""
    if not len(records):
        return np.zeros(0, LOCK_CARRY_DTYPE)
    # NOTE: each field once as a contiguous array (a record's field is strided: numpy reads those slower)
    node, holder = np.ascontiguousarray(records["node"]), np.ascontiguousarray(records["holder"])
    group, order = _pair_groups(node, holder)
    released, held = _stacks(group, order, np.where(records["seq"] != RELEASE, 1, -1))
    first_of = np.unique(group, return_index=True)[1]
    times = released[group[first_of]]
    releases = _records(np.repeat(node[first_of], times), np.repeat(holder[first_of], times), RELEASE, 0)
    return np.concatenate([releases, records[held]])


def request_carry(columns: Mapping[str, np.ndarray], first_seq: int, code_of: Callable[[str], int | None]) -> bytes:
    """The request_carry of a chunk's events (in seq order; the first has seq `first_seq`, or
    `columns` has a "seq" column): the number of open records (8 bytes), the open records
    (REQUEST_OPEN_DTYPE), then the closed rids (int32 codes)."""
    kind = np.asarray(columns["kind"])
    rid = np.asarray(columns["rid"]).astype(np.int64)
    is_match = kind == _code(code_of, EventKind.MATCH.value)
    mask = (is_match | np.isin(kind, [_code(code_of, k.value) for k in REQUEST_ENDS])) & (rid != NO_CODE)
    if not mask.any():
        return b""
    seqs = np.asarray(columns["seq"]) if "seq" in columns else first_seq + np.arange(len(kind))
    where = np.flatnonzero(mask)
    rids = rid[where]
    last = where[len(rids) - 1 - np.unique(rids[::-1], return_index=True)[1]]  # NOTE: each rid's last event
    opened = last[is_match[last]]
    closed = last[~is_match[last]]
    opens = np.empty(len(opened), REQUEST_OPEN_DTYPE)
    opens["rid"], opens["seq"] = rid[opened], seqs[opened]
    opens["step"], opens["hit"] = np.asarray(columns["step"])[opened], np.asarray(columns["num_tokens"])[opened]
    return np.int64(len(opens)).tobytes() + opens.tobytes() + rid[closed].astype("<i4").tobytes()


REQUEST_OPEN_DTYPE = np.dtype([("rid", "<i8"), ("seq", "<i8"), ("step", "<i8"), ("hit", "<i8")])
REQUEST_ENDS = (EventKind.REQUEST_FINISH, EventKind.REQUEST_ABORT, EventKind.REQUEST_RETRACT)


def read_request_carry(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(open records, closed rids) of a request_carry."""
    if not data:
        return np.zeros(0, REQUEST_OPEN_DTYPE), np.zeros(0, np.int64)
    num_open = int(np.frombuffer(data[:8], "<i8")[0])
    end = 8 + num_open * REQUEST_OPEN_DTYPE.itemsize
    if num_open < 0 or end > len(data) or (len(data) - end) % 4:
        raise ValueError(f"{len(data)} bytes are not a request carry of {num_open} open records")
    return np.frombuffer(data[8:end], REQUEST_OPEN_DTYPE), np.frombuffer(data[end:], "<i4").astype(np.int64)


def running_after(carried: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The open records of the requests running after the chunks whose request carries are `carried`
    (in seq order): each rid's latest record, where it is an open one; by rid.

    NOTE: only a rid with an open record can run: per such rid its latest open record, then whether a
    chunk at or after that one closes it (a chunk holds one record per rid, so a close there is later).
    Most closes are of rids never open across a chunk's end (3.1 M of 3.7 M records at 100 M events):
    they are dropped through a table indexed by rid code where the codes are small and dense."""
    opens = _joined([o for o, _ in carried], REQUEST_OPEN_DTYPE)
    if not len(opens):
        return np.zeros(0, REQUEST_OPEN_DTYPE)
    open_ends = np.cumsum([len(o) for o, _ in carried])
    close_ends = np.cumsum([len(c) for _, c in carried])
    open_rids = np.ascontiguousarray(opens["rid"])
    closes = _joined([c for _, c in carried], np.dtype(np.int64))
    latest, closed_rids, closed_at = _latest_opens_and_their_closes(open_rids, closes)
    since = np.searchsorted(open_ends, latest, side="right")  # NOTE: the chunk of each latest open
    last_close = np.full(len(latest), -1, np.int64)
    np.maximum.at(last_close, closed_rids, np.searchsorted(close_ends, closed_at, side="right"))
    return opens[latest[last_close < since]]


def _latest_opens_and_their_closes(open_rids: np.ndarray, closes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each rid's latest open (its index in open_rids, by rid), and the closes of those rids: for each,
    the index of its rid in the first array and its own index in `closes`."""
    low = min(int(open_rids.min()), int(closes.min()) if len(closes) else 0)
    high = max(int(open_rids.max()), int(closes.max()) if len(closes) else 0)
    dense_most = min(4 * (len(open_rids) + len(closes)) + 2**20, 2**31 - 1)
    if low < 0 or high >= dense_most:  # NOTE: sparse codes: sort instead
        latest = len(open_rids) - 1 - np.unique(open_rids[::-1], return_index=True)[1]
        rids = open_rids[latest]
        at = np.minimum(np.searchsorted(rids, closes), len(rids) - 1)
        mine = np.flatnonzero(rids[at] == closes)
        return latest, at[mine], mine
    # NOTE: int32 tables (half the memory of int64): the sparse test above bounds the indices below 2**31
    latest_of = np.full(high + 1, -1, np.int32)
    np.maximum.at(latest_of, open_rids, np.arange(len(open_rids), dtype=np.int32))
    has_open = np.flatnonzero(latest_of >= 0)  # NOTE: by rid
    place = np.full(high + 1, -1, np.int32)
    place[has_open] = np.arange(len(has_open), dtype=np.int32)
    mine = np.flatnonzero(place[closes] >= 0)
    return latest_of[has_open].astype(np.int64), place[closes[mine]].astype(np.int64), mine


def _joined(arrays: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The arrays end to end as one (read-only) array of `dtype`. NOTE: through their bytes: numpy's
    concatenate of thousands of small record arrays costs 4x more."""
    return np.frombuffer(b"".join([np.ascontiguousarray(a, dtype).data for a in arrays]), dtype)
