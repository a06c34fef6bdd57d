"""The block census: at an idle point, every block's ref count against the references the
scheduler can account for, and the free queue against the ref counts. Engine-neutral: an
engine module hands in a BlockView of its pool and its per-request block tables.

NOTE: the terms (each a leak check, pool = the term's name, at most 8 characters)
    leaked    ref count above the accounted references (every group's per-request block tables
              plus deferred frees): a reference nobody will ever drop. Culprit: the request that
              last took the block (alloc or touch), with the step and the event
    lostref   ref count below the accounted references: a block already released once too often
              (a double free); its holders will free it again
    unqueued  ref 0 but not in the free queue: a block nobody can allocate again
    qheld     in the free queue with ref > 0: a block that can be handed out while still in use
    qcount    the free queue's counter differs from the length of its list
    orphans   a block table for a request the scheduler no longer has
A term holds when its list is empty (qcount: when the difference is 0). Every check row carries
the pool's counts, each block in exactly one: total blocks (the null block excluded) = available
(in the free queue, unhashed) + evictable (in the free queue, hashed) + held (ref > 0, not queued)
+ uncached (ref 0, not queued: the unqueued term's blocks); protected is 0. The row's verdict is
its term's alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from kvscope.telemetry import CensusBlock, LeakCheck

TERMS = ("leaked", "lostref", "unqueued", "qheld", "qcount", "orphans")
MAX_NAMED = 8  # NOTE: blocks named in one check's message; the rest are counted there (census_blocks stores all)


class BlockView(NamedTuple):
    """A pool at one moment: ref count of every block (the null block excluded), the hashed
    (cached) blocks, the free queue's blocks in order, and the queue's own counter."""

    ref_counts: dict[int, int]
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

    @property
    def ok(self) -> bool:
        return not (self.leaked or self.lostref or self.unqueued or self.qheld or self.qcount or self.orphans)


def take_census(
    view: BlockView,
    tables: Iterable[Mapping[str, list[Any]]],
    deferred: Iterable[list[Any]],
    live_rids: set[str],
    last_taker: Mapping[int, tuple[str | None, int, str]],
    last_release: Mapping[int, tuple[str | None, int, str]] | None = None,
) -> CensusResult:
    """`tables`: each group's rid -> blocks (objects with block_id and is_null); `deferred`: block
    lists freed later by the scheduler; `live_rids`: the requests the scheduler still has."""
    accounted: Counter[int] = Counter()
    orphans: list[str] = []
    for table in tables:
        for rid, blocks in table.items():
            if blocks and rid not in live_rids:
                orphans.append(rid)
            accounted.update(b.block_id for b in blocks if not b.is_null)
    for blocks in deferred:
        accounted.update(b.block_id for b in blocks if not b.is_null)
    queued = set(view.queued)
    refs = view.ref_counts
    leaked = {b: (r, accounted[b]) for b, r in refs.items() if r > accounted[b]}
    lostref = {b: (r, accounted[b]) for b, r in refs.items() if r < accounted[b]}
    result = CensusResult(
        num_blocks=len(refs),
        num_free=len(view.queued),
        num_cached_free=len(queued & view.hashed),
        num_held=sum(1 for r in refs.values() if r > 0),
        leaked=leaked,
        lostref=lostref,
        unqueued=sorted(b for b, r in refs.items() if r == 0 and b not in queued),
        qheld=sorted(b for b in queued if refs.get(b, 0) > 0),
        qcount=view.queue_counter - len(view.queued),
        orphans=sorted(set(orphans)),
        culprits={},
        releasers={},
    )
    return named(result, last_taker, last_release)


def named(
    result: CensusResult,
    last_taker: Mapping[int, tuple[str | None, int, str]],
    last_release: Mapping[int, tuple[str | None, int, str]] | None,
) -> CensusResult:
    """The census with its culprits named: each leaked block's last taker, each lost reference's
    last release (from whichever ledger the probe keeps)."""
    return result._replace(
        culprits={b: last_taker[b] for b in result.leaked if b in last_taker},
        releasers={b: last_release[b] for b in result.lostref if last_release and b in last_release},
    )


def census_checks(step: int, result: CensusResult) -> list[LeakCheck]:
    """One leak check per term, its violation naming the blocks (and, for a leak, who took them)."""
    held = result.num_held - len(result.qheld)
    counts = (
        result.num_blocks,
        result.num_free - result.num_cached_free,
        result.num_cached_free,
        0,
        held,
        len(result.unqueued),
    )
    return [LeakCheck(step, term, *counts, idle=True, violation=_violation(term, result)) for term in TERMS]


def census_blocks(step: int, result: CensusResult) -> list[CensusBlock]:
    """Every block the census names, one per term (its leak check's message names MAX_NAMED of each):
    a leaked block with its last taker, a lost reference with its last release."""
    blocks = [
        CensusBlock(step, "leaked", b, ref, accounted, taker=result.culprits.get(b))
        for b, (ref, accounted) in sorted(result.leaked.items())
    ]
    blocks += [
        CensusBlock(step, "lostref", b, ref, accounted, releaser=result.releasers.get(b))
        for b, (ref, accounted) in sorted(result.lostref.items())
    ]
    blocks += [CensusBlock(step, "unqueued", b, 0) for b in result.unqueued]
    return blocks + [CensusBlock(step, "qheld", b) for b in result.qheld]


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
        "culprits": {str(b): {"rid": c[0], "step": c[1], "event": c[2]} for b, c in result.culprits.items()},
        "releasers": {str(b): {"rid": c[0], "step": c[1], "event": c[2]} for b, c in result.releasers.items()},
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
            f"{_blocks(len(result.lostref))} released too often (a double free): "
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
    return None


def _leak_text(block: int, result: CensusResult) -> str:
    ref, accounted = result.leaked[block]
    taker = result.culprits.get(block)
    who = f"; last taken by request {taker[0]} ({taker[2]} at step {taker[1]})" if taker else "; taker not recorded"
    return f"block {block} ref {ref}, accounted {accounted}{who}"


def _lost_text(block: int, result: CensusResult) -> str:
    ref, accounted = result.lostref[block]
    last = result.releasers.get(block)
    who = f"; last released for request {last[0]} ({last[2]} at step {last[1]})" if last else ""
    return f"block {block} ref {ref}, accounted {accounted}{who}"


def _blocks(count: int) -> str:
    return f"{count} block{'s' if count != 1 else ''}"


def _named(blocks: list[int]) -> str:
    return ", ".join(map(str, blocks[:MAX_NAMED])) + _more(len(blocks))


def _more(count: int) -> str:
    return f" (+{count - MAX_NAMED} more)" if count > MAX_NAMED else ""
