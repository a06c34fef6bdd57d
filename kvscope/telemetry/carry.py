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
    lock_carry    per (node, holder) whose locks the chunk changes for later steps (JSON): [node,
                  holder, releases, [[seq, step], ...]]: `releases` unlocks that found none of the
                  chunk's own locks held (they release the latest locks held before the chunk, as
                  many as there are), then the chunk's own locks still held at its end, in seq
                  order. A holder is a rid's code (NO_CODE: none) or a host-tier copy's
                  "write|load <aux>" (held_locks' lock_holder). Per (node, holder) the locks form
                  a stack (an unlock releases the latest lock, and one with none held releases
                  nothing), and a stack's changes compose: pop `releases` (at most its height),
                  push the rest. So the locks held after a step are the chunks' carries applied in
                  seq order, exactly what replaying every lock and unlock up to it gives.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from kvscope.telemetry.events import EventKind

NO_CODE = -1  # NOTE: packed.NO_CODE (packed imports this module)
NULL_INT = np.iinfo(np.int64).min  # NOTE: packed.NULL_INT
EVICT_STEP_DTYPE = np.dtype([("step", "<i8"), ("evictions", "<i8"), ("tokens", "<i8"), ("t_mono", "<f8")])
CARRY_FIELDS = ("kind", "step", "t_mono", "num_tokens", "node_id", "rid", "reason", "aux")  # NOTE: what carries read
COPY_REASONS = ("write", "load")  # NOTE: a lock without a rid for one of these is a host-tier copy's
Held = dict[tuple[int, Any], list[tuple[int, int]]]  # (node, holder) -> [(seq, step)] held, oldest first


def carries(
    columns: Mapping[str, np.ndarray], first_seq: int, code_of: Callable[[str], int | None]
) -> tuple[bytes, str]:
    """A chunk's (evict_steps, lock_carry) from its CARRY_FIELDS columns (strings as codes, node_id
    with NULL_INT; `code_of`: a string's code, None when the run has none)."""
    kind = np.asarray(columns["kind"])
    return evict_steps(columns, kind == _code(code_of, EventKind.EVICT.value)), lock_carry(columns, first_seq, code_of)


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


def lock_carry(columns: Mapping[str, np.ndarray], first_seq: int, code_of: Callable[[str], int | None]) -> str:
    """The lock_carry JSON of a chunk's events (in seq order; the first has seq `first_seq`, or
    `columns` has a "seq" column: some events of one chunk, or of the row layout)."""
    kind = np.asarray(columns["kind"])
    node = np.asarray(columns["node_id"]).astype(np.int64)
    is_lock = kind == _code(code_of, EventKind.LOCK.value)
    mask = (is_lock | (kind == _code(code_of, EventKind.UNLOCK.value))) & (node != NULL_INT)
    if not mask.any():
        return "[]"
    seqs = np.asarray(columns["seq"]) if "seq" in columns else first_seq + np.arange(len(kind))
    seq = seqs[mask].astype(np.int64)
    holder, named = _holders(columns, mask, code_of)
    pairs = np.stack([node[mask], holder], axis=1)
    keys, group = np.unique(pairs, axis=0, return_inverse=True)
    group = group.reshape(-1)
    releases, held = _stacks(group, np.where(is_lock[mask], 1, -1))
    step = np.asarray(columns["step"])[mask].astype(np.int64)
    out: list[list[Any]] = []
    for g in np.flatnonzero((releases > 0) | np.bincount(group[held], minlength=len(keys)).astype(bool)).tolist():
        mine = held & (group == g)
        node_id, code = (int(v) for v in keys[g])
        kept = [[int(q), int(s)] for q, s in zip(seq[mine].tolist(), step[mine].tolist(), strict=True)]
        out.append([node_id, named.get(code, code), int(releases[g]), kept])
    return json.dumps(out, separators=(",", ":"))


def _holders(
    columns: Mapping[str, np.ndarray], mask: np.ndarray, code_of: Callable[[str], int | None]
) -> tuple[np.ndarray, dict[int, str]]:
    """Each masked event's holder as an int (a rid code, NO_CODE: none; a copy: a key below -1)
    and the copies' names by key."""
    rid = np.asarray(columns["rid"])[mask].astype(np.int64)
    reason = np.asarray(columns["reason"])[mask].astype(np.int64)
    aux = np.asarray(columns["aux"])[mask].astype(np.int64)
    named: dict[int, str] = {}
    for text in COPY_REASONS:
        copy = (rid == NO_CODE) & (reason == _code(code_of, text))
        for value in np.unique(aux[copy]).tolist():
            key = -2 - len(named)
            named[key] = f"{text} {value}"
            rid = np.where(copy & (aux == value), key, rid)
    return rid, named


def _stacks(group: np.ndarray, change: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group, the releases that found its stack empty, and per event whether it is a lock still
    held at the end (events in seq order; change +1 lock, -1 unlock).

    NOTE: per group, in seq order, the height after each event is the running sum c reflected at 0:
    c - min(0, running min of c); a lock is held iff no later event of its group is lower, and the
    releases that found the stack empty are -min(0, min c). The running minima restart per group by
    moving group g down by g * span (each group then lies below every earlier one)."""
    order = np.argsort(group, kind="stable")
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


def apply_lock_carry(held: Held, carry: Iterable[list[Any]]) -> None:
    """Apply one chunk's lock_carry (parsed) to the locks held before it."""
    for node, holder, releases, kept in carry:
        key = (int(node), holder)
        stack = held.get(key)
        if stack is not None and releases:
            del stack[max(0, len(stack) - int(releases)) :]
        if kept:
            held.setdefault(key, []).extend((int(q), int(s)) for q, s in kept)
