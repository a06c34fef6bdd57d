"""The vLLM probe's census, rebuilt from its block events: replaying a capture's alloc / lock /
revive / insert / evict / free / unlock events (level full) gives every block's ref count, whether
it sits in the free queue and whether it is hashed; at each stored idle census the replay's pool is
compared with what the census stored (its counts, and the blocks each term named).

NOTE: the replay's rules (kvscope/probe/vllm.py says what each event means)
    alloc    each block: ref + 1 (0 -> 1), out of the free queue
    lock     each block: ref + 1;  revive: each block out of the free queue
    free     each block reached ref 0: ref = 0, into the free queue
    unlock   each block: ref - 1, still nonzero; a replayed 0 means the engine held a reference no
             event showed (a leak behind the pool's back): the replay keeps 1, the least the event allows
    insert   node_id is hashed;  evict: node_id loses its hash (reason reset: every block)
The pool starts as vLLM's does: blocks 1..total (block 0 is vLLM's null block) in the free queue,
ref 0, none hashed. At an idle census no request is left, so nothing is accounted: leaked = ref > 0
outside the queue or not, lostref = ref < 0, unqueued = ref 0 outside the queue, qheld = ref > 0 in
it. Not compared (no event shows them): qcount (the queue's own counter) and orphans (block tables).
A census names at most MAX_NAMED blocks per term: the replay compares each term's count and the
blocks (and, for leaked and lostref, their ref counts) it named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvscope.telemetry import Capture, decode_slots

COMPARED = ("leaked", "lostref", "unqueued", "qheld")
MAX_NAMED = 8  # NOTE: kvscope/probe/census.py's; the probe package is not imported here (layering)
COLUMNS = ["seq", "step", "kind", "node_id", "reason", "slots"]
_STORED = re.compile(r"^\[\w+\][^:]*: ")  # NOTE: the stored message leads with the term and its counts
_COUNT = re.compile(r"^(\d+) blocks?\b")
_REF = re.compile(r"block (\d+) ref (-?\d+), accounted (\d+)")
_LIST = re.compile(r": ([\d, ]+)(?: \(\+\d+ more\))?$")


class Counts(NamedTuple):
    total: int
    available: int  # in the free queue, unhashed
    evictable: int  # in the free queue, hashed
    held: int  # ref > 0, outside the queue
    uncached: int  # ref 0, outside the queue


class Term(NamedTuple):
    """One census term as named: how many blocks, and the first MAX_NAMED (block, ref or None)."""

    num_blocks: int
    named: tuple[tuple[int, int | None], ...]


class CensusPoint(NamedTuple):
    step: int
    stored: Counts
    replayed: Counts
    stored_terms: dict[str, Term]
    replayed_terms: dict[str, Term]

    @property
    def agrees(self) -> bool:
        return self.stored == self.replayed and self.stored_terms == self.replayed_terms

    def differences(self) -> list[str]:
        out = [] if self.stored == self.replayed else [f"counts: stored {self.stored}, replayed {self.replayed}"]
        return out + [
            f"{t}: stored {self.stored_terms[t]}, replayed {self.replayed_terms[t]}"
            for t in COMPARED
            if self.stored_terms[t] != self.replayed_terms[t]
        ]


@dataclass
class PoolReplay:
    """vLLM's block pool as the events show it."""

    total: int
    ref: dict[int, int] = field(default_factory=dict)
    queued: set[int] = field(default_factory=set)
    hashed: set[int] = field(default_factory=set)
    hidden: set[int] = field(default_factory=set)  # blocks an unlock showed held by a reference no event made

    def __post_init__(self) -> None:
        self.ref = {block: 0 for block in range(1, self.total + 1)}
        self.queued = set(self.ref)

    def apply(self, kind: str, node_id: int | None, reason: str | None, slots: list[int]) -> None:
        if kind in ("alloc", "lock"):
            for block in slots:
                self.ref[block] = self.ref.get(block, 0) + 1
                if kind == "alloc":
                    self.queued.discard(block)
        elif kind == "revive":
            self.queued.difference_update(slots)
        elif kind == "free":
            for block in slots:
                self.ref[block] = 0
            self.queued.update(slots)
        elif kind == "unlock":
            for block in slots:
                self.ref[block] = self.ref.get(block, 0) - 1
                if self.ref[block] == 0:
                    self.ref[block] = 1
                    self.hidden.add(block)
        elif kind == "insert" and node_id is not None:
            self.hashed.add(int(node_id))
        elif kind == "evict":
            if reason == "reset":
                self.hashed.clear()
            elif node_id is not None:
                self.hashed.discard(int(node_id))

    def counts(self) -> Counts:
        queued, outside = self.queued, [r for b, r in self.ref.items() if b not in self.queued]
        return Counts(
            self.total,
            len(queued - self.hashed),
            len(queued & self.hashed),
            sum(1 for r in outside if r > 0),
            sum(1 for r in outside if r == 0),
        )

    def terms(self) -> dict[str, Term]:
        """The idle census's terms (nothing accounted: no request is left at an idle point)."""
        ref, queued = self.ref, self.queued
        return {
            "leaked": _term([(b, r) for b, r in ref.items() if r > 0]),
            "lostref": _term([(b, r) for b, r in ref.items() if r < 0]),
            "unqueued": _term([(b, None) for b, r in ref.items() if r == 0 and b not in queued]),
            "qheld": _term([(b, None) for b in queued if ref.get(b, 0) > 0]),
        }


def _term(blocks: list[tuple[int, int | None]]) -> Term:
    ordered = sorted(blocks)
    return Term(len(ordered), tuple(ordered[:MAX_NAMED]))


def stored_term(term: str, message: object) -> Term:
    """The blocks a stored census term named (its violation text; None or NaN: the term held)."""
    if not isinstance(message, str) or not message:
        return Term(0, ())
    message = _STORED.sub("", message, count=1)
    count = _COUNT.match(message)
    if count is None:
        raise ValueError(f"census term {term}: cannot read {message!r}")
    named: tuple[tuple[int, int | None], ...]
    if term in ("leaked", "lostref"):
        named = tuple((int(b), int(r)) for b, r, _ in _REF.findall(message))
    else:
        listed = _LIST.search(message)
        named = tuple((int(b), None) for b in listed.group(1).split(", ")) if listed else ()
    return Term(int(count.group(1)), named)


def replay_census(capture: Capture, run_id: int) -> list[CensusPoint]:
    """Every stored idle census of the run against the replay of the events up to its step. A census
    taken while requests held blocks (busy, drain, poll) is not replayed: the events do not show the
    block tables, and only at an idle point does every reference have to be gone."""
    checks = capture.leak_checks(run_id)
    checks = checks[checks.pool.isin(COMPARED)]
    if "census" in checks:
        checks = checks[checks.census.isna() | (checks.census == "idle")]
    if checks.empty:
        return []
    points: list[CensusPoint] = []
    by_step = [(int(step), rows) for step, rows in checks.groupby("step", sort=True)]
    pool = PoolReplay(int(by_step[0][1].total.iloc[0]))
    at = 0
    for batch in capture.event_stream(run_id, COLUMNS):
        for _, step, kind, node_id, reason, slots in batch:
            while at < len(by_step) and step > by_step[at][0]:
                points.append(_point(pool, *by_step[at]))
                at += 1
            pool.apply(str(kind), node_id, reason, _slots(slots))
    points.extend(_point(pool, step, rows) for step, rows in by_step[at:])
    return points


def _point(pool: PoolReplay, step: int, rows: Any) -> CensusPoint:
    first = rows.iloc[0]
    stored = Counts(int(first.total), int(first.available), int(first.evictable), int(first.held), int(first.uncached))
    messages = {str(r.pool): r.message for r in rows.itertuples(index=False)}
    terms = {t: stored_term(t, messages.get(t)) for t in COMPARED}
    return CensusPoint(step, stored, pool.counts(), terms, pool.terms())


def _slots(slots: Any) -> list[int]:
    if slots is None:
        return []
    if isinstance(slots, bytes | bytearray | memoryview):
        return decode_slots(bytes(slots))
    return [int(s) for s in slots]
