"""The block census: every block's ref count against the references the scheduler can account
for, and the free queue against the ref counts. It runs on the engine's thread between steps: at
each busy -> idle edge, periodically while busy, at the drain as the engine shuts down, and when
polled live. Engine-neutral: an engine module hands in a BlockView of its pool and its per-request
block tables.

NOTE: the terms (each a leak check, pool = the term's name, at most 8 characters)
    leaked    ref count above the accounted references (every group's per-request block tables
              plus deferred frees and pending copies): a reference nobody will ever drop
    lostref   ref count below the accounted references: a block released once too often (a double
              free), or put in a table without a reference (a prefix hit that took none)
    unqueued  ref 0 but not in the free queue: a block nobody can allocate again
    qheld     in the free queue with ref > 0: a block that can be handed out while still in use
    qcount    the free queue's counter differs from the length of its list
    orphans   a block table for a request the scheduler no longer has
    lingered  a block held only by requests that ended (finished or aborted) but still sit in the
              scheduler's table past the lingering bounds (a delayed free that never came)
A term holds when its list is empty (qcount: when the difference is 0). Every check row carries
the pool's counts, each block in exactly one: total blocks (the null block excluded) = available
(in the free queue, unhashed) + evictable (in the free queue, hashed) + held (ref != 0, not queued:
a negative count, left by a double free, is held here and named by lostref)
+ uncached (ref 0, not queued: the unqueued term's blocks); protected is 0. The row's verdict is
its term's alone.
NOTE: culprits (a request is named only for what the probe saw its own call do)
    lostref   the request whose prefix hit put the block in its table without a reference (the
              probe compares the hit blocks' ref counts around the call); otherwise unknown: the
              census sees one release too many, not which release was the extra one (the last
              release is stated as a fact, not as the culprit)
    leaked    unknown: the census sees a reference no table accounts for, not whose take lacked its
              release (the last take is stated as a fact)
    lingered  the lingering requests that hold the block (they are what keeps it)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from kvscope.telemetry import CensusBlock, LeakCheck

TERMS = ("leaked", "lostref", "unqueued", "qheld", "qcount", "orphans", "lingered")
CENSUS_KINDS = ("busy", "idle", "drain", "crash", "poll")  # NOTE: leak_checks.census
MAX_NAMED = 8  # NOTE: blocks named in one check's message; the rest are counted there (census_blocks stores all)

Ledger = Mapping[int, tuple[str | None, int, str]]  # block -> (rid, step, event) of its last take or release


class BlockView(NamedTuple):
    """A pool at one moment: the ref count of every block (a dict by block id, or an int array
    indexed by block id whose index 0, vLLM's null block, is not a block), the hashed blocks (at
    least those in the free queue), the free queue's blocks in order, and the queue's own counter."""

    ref_counts: Mapping[int, int] | np.ndarray
    hashed: set[int]
    queued: list[int]
    queue_counter: int


class CensusResult(NamedTuple):
    num_blocks: int
    num_free: int
    num_cached_free: int
    num_held: int
    leaked: dict[int, tuple[int, int]]  # block -> (ref count, accounted references)
    lostref: dict[int, tuple[int, int]]
    unqueued: list[int]
    qheld: list[int]
    qcount: int  # counter - list length
    orphans: list[str]
    culprits: dict[int, tuple[str | None, int, str]]  # leaked block -> (rid, step, event) of its last taker
    releasers: dict[int, tuple[str | None, int, str]]  # lostref block -> (rid, step, event) of its last release
    lingered: dict[int, tuple[str, ...]]  # block held only by lingering requests -> those requests
    unpinned: dict[int, tuple[str, int]]  # lostref block -> (rid, step) of a hit that took no reference
    since: dict[str, int]  # lingering request -> the step it ended at

    @property
    def ok(self) -> bool:
        return not (
            self.leaked or self.lostref or self.unqueued or self.qheld or self.qcount or self.orphans or self.lingered
        )


def take_census(
    view: BlockView,
    tables: Iterable[Mapping[str, list[Any]]],
    deferred: Iterable[list[Any]],
    live_rids: set[str],
    last_taker: Ledger,
    last_release: Ledger | None = None,
    *,
    lingering: Mapping[str, int] | None = None,
    unpinned: Mapping[int, tuple[str, int]] | None = None,
) -> CensusResult:
    """`tables`: each group's rid -> blocks (objects with block_id and is_null); `deferred`: block
    lists freed later by the scheduler (or held for a pending copy); `live_rids`: the requests the
    scheduler still has, lingering ones included; `lingering`: those that ended and lingered past
    the bounds -> the step they ended at; `unpinned`: blocks a prefix hit put in a request's table
    without a reference -> (that request, the step)."""
    lingering = lingering or {}
    ids, refs = _ref_arrays(view.ref_counts)
    tables = list(tables)
    size = int(ids.max()) + 1 if len(ids) else 1
    kept, lingered_by, orphans = _table_ids(tables, live_rids, lingering)
    extra = [b.block_id for blocks in deferred for b in blocks if not b.is_null]
    size = max([size, *(max(a) + 1 for a in (kept, lingered_by, extra) if a)])
    live_acc = np.bincount(np.asarray(kept, dtype=np.int64), minlength=size)
    linger_acc = np.bincount(np.asarray(lingered_by, dtype=np.int64), minlength=size)
    other_acc = np.bincount(np.asarray(extra, dtype=np.int64), minlength=size)
    accounted = (live_acc + linger_acc + other_acc)[ids]
    queued = np.zeros(size, dtype=bool)
    queued[np.asarray(view.queued, dtype=np.int64)] = True
    in_queue = queued[ids]
    over, under = refs > accounted, refs < accounted
    only_lingering = (refs > 0) & (linger_acc[ids] > 0) & (live_acc[ids] == 0) & (other_acc[ids] == 0)
    result = CensusResult(
        num_blocks=len(ids),
        num_free=len(view.queued),
        num_cached_free=len(set(view.queued) & view.hashed),
        num_held=int(np.count_nonzero((refs != 0) & ~in_queue) + np.count_nonzero(in_queue & (refs > 0))),
        leaked={int(b): (int(r), int(a)) for b, r, a in zip(ids[over], refs[over], accounted[over], strict=True)},
        lostref={int(b): (int(r), int(a)) for b, r, a in zip(ids[under], refs[under], accounted[under], strict=True)},
        unqueued=sorted(int(b) for b in ids[(refs == 0) & ~in_queue]),
        qheld=sorted(int(b) for b in ids[in_queue & (refs > 0)]),
        qcount=view.queue_counter - len(view.queued),
        orphans=sorted(orphans),
        culprits={},
        releasers={},
        lingered=_lingering_holders(tables, lingering, {int(b) for b in ids[only_lingering]}),
        unpinned={},
        since={},
    )
    return named(result, last_taker, last_release, unpinned=_unpinned_held(result, tables, unpinned), since=lingering)


def _ref_arrays(refs: Mapping[int, int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(block ids, their ref counts) as int arrays."""
    if isinstance(refs, np.ndarray):
        return np.arange(1, len(refs), dtype=np.int64), refs[1:].astype(np.int64)
    ids = np.fromiter(refs.keys(), dtype=np.int64, count=len(refs))
    return ids, np.fromiter(refs.values(), dtype=np.int64, count=len(refs))


def _table_ids(
    tables: list[Mapping[str, list[Any]]], live_rids: set[str], lingering: Mapping[str, int]
) -> tuple[list[int], list[int], set[str]]:
    """Every table's block ids: those of requests that still count as holders, those of requests
    lingering past the bounds, and the requests whose tables outlived them (orphans)."""
    kept: list[int] = []
    lingered_by: list[int] = []
    orphans: set[str] = set()
    for table in tables:
        for rid, blocks in table.items():
            if not blocks:
                continue
            if rid not in live_rids:
                orphans.add(rid)
            into = lingered_by if rid in lingering else kept
            into += [b.block_id for b in blocks if not b.is_null]
    return kept, lingered_by, orphans


def _lingering_holders(
    tables: list[Mapping[str, list[Any]]], lingering: Mapping[str, int], blocks: set[int]
) -> dict[int, tuple[str, ...]]:
    """Each block held only by lingering requests -> those requests (sorted)."""
    if not blocks:
        return {}
    holders: dict[int, set[str]] = {}
    for table in tables:
        for rid in lingering:
            for b in table.get(rid, ()):
                if b.block_id in blocks:
                    holders.setdefault(b.block_id, set()).add(rid)
    return {b: tuple(sorted(rids)) for b, rids in sorted(holders.items())}


def _unpinned_held(
    result: CensusResult, tables: list[Mapping[str, list[Any]]], unpinned: Mapping[int, tuple[str, int]] | None
) -> dict[int, tuple[str, int]]:
    """The lostref blocks a prefix hit put in a table without a reference, whose request still holds
    them there (that request's own call made the count wrong)."""
    found = {}
    for block, (rid, step) in (unpinned or {}).items():
        if block in result.lostref and any(
            b.block_id == block for table in tables for b in table.get(rid, ()) if not b.is_null
        ):
            found[block] = (rid, step)
    return found


def named(
    result: CensusResult,
    last_taker: Ledger,
    last_release: Ledger | None,
    *,
    unpinned: dict[int, tuple[str, int]] | None = None,
    since: Mapping[str, int] | None = None,
) -> CensusResult:
    """The census with what the ledger says: each leaked block's last take, each lost reference's
    last release (from whichever ledger the probe keeps), the hits that took no reference."""
    return result._replace(
        culprits={b: last_taker[b] for b in result.leaked if b in last_taker},
        releasers={b: last_release[b] for b in result.lostref if last_release and b in last_release},
        unpinned=result.unpinned if unpinned is None else unpinned,
        since=result.since if since is None else {r: since[r] for rids in result.lingered.values() for r in rids},
    )


def census_checks(step: int, result: CensusResult, census: str | None = None) -> list[LeakCheck]:
    """One leak check per term, its violation naming the blocks (and what the ledger says of them);
    `census`: which census it was (CENSUS_KINDS)."""
    held = result.num_held - len(result.qheld)
    counts = (
        result.num_blocks,
        result.num_free - result.num_cached_free,
        result.num_cached_free,
        0,
        held,
        len(result.unqueued),
    )
    return [
        LeakCheck(step, term, *counts, idle=True, violation=_violation(term, result), census=census) for term in TERMS
    ]


def census_blocks(step: int, result: CensusResult) -> list[CensusBlock]:
    """Every block the census names, one per term (its leak check's message names MAX_NAMED of each):
    a leaked block with its last taker, a lost reference with its last release (and, as its taker, the
    request whose prefix hit took no reference, when the probe saw one), a lingered block with the
    requests that hold it (comma-joined, as taker_rid) and the step the first of them ended."""
    blocks = [
        CensusBlock(step, "leaked", b, ref, accounted, taker=result.culprits.get(b))
        for b, (ref, accounted) in sorted(result.leaked.items())
    ]
    blocks += [
        CensusBlock(step, "lostref", b, ref, accounted, taker=_unpinned(b, result), releaser=result.releasers.get(b))
        for b, (ref, accounted) in sorted(result.lostref.items())
    ]
    blocks += [CensusBlock(step, "unqueued", b, 0) for b in result.unqueued]
    blocks += [CensusBlock(step, "qheld", b) for b in result.qheld]
    return blocks + [
        CensusBlock(
            step, "lingered", b, taker=(",".join(rids)[:64], min(result.since.get(r, step) for r in rids), "lingering")
        )
        for b, rids in sorted(result.lingered.items())
    ]


def _unpinned(block: int, result: CensusResult) -> tuple[str | None, int, str] | None:
    """The request whose prefix hit put a lost-reference block in its table without a reference."""
    hit = result.unpinned.get(block)
    return None if hit is None else (hit[0], hit[1], "unpinned hit")


def census_json(result: CensusResult, pid: int, dp_rank: int) -> dict[str, Any]:
    """The census as plain JSON values (GET /kvscope/census): counts, each term, the culprits."""
    return {
        "pid": pid,
        "dp_rank": dp_rank,
        "ok": result.ok,
        "blocks": result.num_blocks,
        "free": result.num_free,
        "cached_free": result.num_cached_free,
        "held": result.num_held,
        "leaked": sorted(result.leaked),
        "lostref": sorted(result.lostref),
        "unqueued": result.unqueued,
        "qheld": result.qheld,
        "qcount": result.qcount,
        "orphans": result.orphans,
        "lingered": {str(b): list(rids) for b, rids in result.lingered.items()},
        "culprits": {str(b): {"rid": c[0], "step": c[1], "event": c[2]} for b, c in result.culprits.items()},
        "releasers": {str(b): {"rid": c[0], "step": c[1], "event": c[2]} for b, c in result.releasers.items()},
        "unpinned": {str(b): {"rid": c[0], "step": c[1]} for b, c in result.unpinned.items()},
        "violations": [v for v in (_violation(t, result) for t in TERMS) if v is not None],
    }


def _violation(term: str, result: CensusResult) -> str | None:
    if term == "leaked" and result.leaked:
        return (
            f"{_blocks(len(result.leaked))} leaked: "
            + "; ".join(_leak_text(b, result) for b in sorted(result.leaked)[:MAX_NAMED])
            + _more(len(result.leaked))
        )
    if term == "lostref" and result.lostref:
        return (
            f"{_blocks(len(result.lostref))} released too often or hit without a reference: "
            + "; ".join(_lost_text(b, result) for b in sorted(result.lostref)[:MAX_NAMED])
            + _more(len(result.lostref))
        )
    if term == "unqueued" and result.unqueued:
        return f"{_blocks(len(result.unqueued))} with ref 0 missing from the free queue: {_named(result.unqueued)}"
    if term == "qheld" and result.qheld:
        return f"{_blocks(len(result.qheld))} referenced and in the free queue: {_named(result.qheld)}"
    if term == "qcount" and result.qcount:
        return f"the free queue's counter is {result.qcount:+d} off its list's length"
    if term == "orphans" and result.orphans:
        return (
            f"{len(result.orphans)} block tables of requests that no longer exist: "
            + ", ".join(result.orphans[:MAX_NAMED])
            + _more(len(result.orphans))
        )
    if term == "lingered" and result.lingered:
        return (
            f"{_blocks(len(result.lingered))} held only by requests that ended and linger past the bounds: "
            + "; ".join(_linger_text(b, result) for b in list(result.lingered)[:MAX_NAMED])
            + _more(len(result.lingered))
        )
    return None


def _leak_text(block: int, result: CensusResult) -> str:
    ref, accounted = result.leaked[block]
    taker = result.culprits.get(block)
    last = "; taker not recorded" if taker is None else _fact("taken", taker)
    return (
        f"block {block} ref {ref}, accounted {accounted}{last}; culprit unknown: the census sees a reference "
        "no table accounts for, not whose take lacked its release"
    )


def _lost_text(block: int, result: CensusResult) -> str:
    ref, accounted = result.lostref[block]
    hit = result.unpinned.get(block)
    if hit is not None:
        return (
            f"block {block} ref {ref}, accounted {accounted}; culprit request {hit[0]}: its prefix hit at step "
            f"{hit[1]} put the block in its table without taking a reference"
        )
    last = result.releasers.get(block)
    fact = "" if last is None else _fact("released", last, by="for")
    return (
        f"block {block} ref {ref}, accounted {accounted}{fact}; culprit unknown: the census sees one "
        "release too many, not which release was the extra one"
    )


def _fact(what: str, entry: tuple[str | None, int, str], by: str = "by") -> str:
    """What the ledger says of a block's last take or release, stated as a fact, not as the culprit."""
    rid, step, event = entry
    if rid is None:
        return f"; last {what} outside any request's call ({event} at step {step})"
    return f"; last {what} {by} request {rid} ({event} at step {step})"


def _linger_text(block: int, result: CensusResult) -> str:
    rids = result.lingered[block]
    ended = ", ".join(f"{rid} (ended at step {result.since[rid]})" if rid in result.since else rid for rid in rids)
    return f"block {block} held by {ended}"


def _blocks(count: int) -> str:
    return f"{count} block{'s' if count != 1 else ''}"


def _named(blocks: list[int]) -> str:
    return ", ".join(map(str, blocks[:MAX_NAMED])) + _more(len(blocks))


def _more(count: int) -> str:
    return f" (+{count - MAX_NAMED} more)" if count > MAX_NAMED else ""
