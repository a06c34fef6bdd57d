"""The ledger's cheap per-step verdict against the brute-force one, on arbitrary event streams
(the ledger reads buggy streams too, so any order of any event must keep it consistent)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.debug.ledger import APPLY_COLUMNS, FREE, IGNORED_KINDS, REQUEST, Ledger
from kvscope.telemetry import EventKind, schema

KINDS = (EventKind.ALLOC, EventKind.FREE, EventKind.INSERT, EventKind.SPLIT, EventKind.EVICT, EventKind.REVIVE,
         EventKind.REQUEST_ADMIT, EventKind.REQUEST_FINISH, EventKind.REQUEST_RETRACT, EventKind.REQUEST_ABORT,
         EventKind.LOCK, EventKind.UNLOCK)
UNIVERSE = 16  # slots 0..15: small, so events collide often

slot_sets = st.lists(st.integers(0, UNIVERSE - 1), min_size=0, max_size=8, unique=True)
events = st.tuples(st.sampled_from(KINDS), st.sampled_from(("full", "swa")), st.sampled_from(("a", "b", "c", None)),
                   st.integers(0, 2), st.integers(0, 4), st.integers(0, 2), slot_sets)


def brute_broken(ledger: Ledger) -> bool:
    return bool(ledger.double_frees or ledger.locks_of_ended_requests() or ledger.orphans())


def brute_orphaned_owners(ledger: Ledger) -> set[tuple[int, int]]:
    """Every (kind, ref) owning a slot in a pool scan, whose request ended or whose node is gone."""
    found = set()
    for pool in ledger.pools.values():
        for kind, ref in zip(pool.kind.tolist(), pool.ref.tolist(), strict=True):
            if kind != FREE and ref not in (ledger.live if kind == REQUEST else ledger.node_slots):
                found.add((kind, ref))
    return found


def check(ledger: Ledger, where: object) -> None:
    ledger.check_integrity()
    assert ledger.orphaned_owners() == brute_orphaned_owners(ledger), where
    assert ledger.is_broken() == brute_broken(ledger), where


def owned_slots(ledger: Ledger, kind: EventKind, pool: str, rid: str | None, node: int) -> list[int] | None:
    """The slots the event's owner holds now (so frees and evictions empty an owner, as real ones do)."""
    if kind is EventKind.EVICT:
        held = ledger.node_slots.get(node)
        return None if held is None else held.tolist()
    if kind is EventKind.FREE and rid is not None and rid in ledger.rid_index:
        pool_ledger = ledger.pools[pool]
        return np.flatnonzero((pool_ledger.kind == 1) & (pool_ledger.ref == ledger.rid_index[rid])).tolist()
    return None


@settings(max_examples=300, deadline=None)
@given(st.lists(events, min_size=20, max_size=60), st.integers(1, 5), st.data())
def test_per_step_verdict_equals_the_pool_scan(stream: list, check_every: int, data: st.DataObject) -> None:
    ledger = Ledger()
    for seq, (kind, pool, rid, node, num_tokens, aux, slots) in enumerate(stream):
        owned = owned_slots(ledger, kind, pool, rid, node)
        if owned is not None and data.draw(st.booleans()):
            slots = owned
        ledger.apply(kind, seq // 3, seq, pool, rid, node, num_tokens, aux, np.array(slots, dtype=np.int64))
        if seq % check_every == 0:
            check(ledger, (seq, kind))
    check(ledger, "end")


def test_a_request_that_ends_holding_slots_breaks_it_and_freeing_them_heals_it() -> None:
    ledger = Ledger()
    ledger.apply(EventKind.REQUEST_ADMIT, 0, 0, None, "r", None, 0, 0, None)
    ledger.apply(EventKind.ALLOC, 0, 1, "full", "r", None, 3, 0, np.array([4, 5, 6]))
    assert not ledger.is_broken()
    ledger.apply(EventKind.REQUEST_FINISH, 1, 2, None, "r", None, 0, 0, None)
    assert ledger.is_broken()
    ledger.apply(EventKind.FREE, 1, 3, "full", "r", None, 3, 0, np.array([4, 5, 6]))
    assert not ledger.is_broken()
    ledger.check_integrity()


def test_a_node_evicted_before_its_slots_are_freed_holds_orphans_until_they_are() -> None:
    ledger = Ledger()
    ledger.apply(EventKind.INSERT, 0, 0, "full", None, 3, 2, 0, np.array([1, 2]))
    assert not ledger.is_broken()
    ledger.apply(EventKind.EVICT, 1, 1, "full", None, 3, 2, 0, np.array([1, 2]))
    assert ledger.is_broken()
    ledger.apply(EventKind.FREE, 1, 2, "full", None, None, 2, 0, np.array([1, 2]))
    assert not ledger.is_broken()
    ledger.check_integrity()


def test_every_event_kind_is_handled_or_deliberately_ignored() -> None:
    handled = set(Ledger()._handlers)
    assert handled | IGNORED_KINDS == set(EventKind)
    assert not handled & IGNORED_KINDS


def test_apply_takes_event_columns_in_its_parameter_order() -> None:
    assert APPLY_COLUMNS == ("kind", "step", "seq", "pool", "rid", "node_id", "num_tokens", "aux", "slots")
    assert set(APPLY_COLUMNS) <= set(schema.EVENT_COLUMNS)
