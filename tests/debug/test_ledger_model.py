"""The ledger's cheap per-step verdict against the brute-force one, on arbitrary event streams
(the ledger reads buggy streams too, so any order of any event must keep it consistent); and the
host tier's life cycle (hiradix: host copies, copy ops and their locks) event by event."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.debug.ledger import APPLY_COLUMNS, FREE, HOST_COPY, IGNORED_KINDS, REQUEST, TREE, Ledger
from kvscope.telemetry import EventKind, schema

KINDS = (
    EventKind.ALLOC,
    EventKind.FREE,
    EventKind.INSERT,
    EventKind.SPLIT,
    EventKind.EVICT,
    EventKind.REVIVE,
    EventKind.REQUEST_ADMIT,
    EventKind.REQUEST_FINISH,
    EventKind.REQUEST_RETRACT,
    EventKind.REQUEST_ABORT,
    EventKind.LOCK,
    EventKind.UNLOCK,
    EventKind.WRITE,
    EventKind.LOAD,
    EventKind.ACK,
    EventKind.HOST_EVICT,
    EventKind.LEAK_CHECK,
)
UNIVERSE = 16  # slots 0..15: small, so events collide often

slot_sets = st.lists(st.integers(0, UNIVERSE - 1), min_size=0, max_size=8, unique=True)
events = st.tuples(
    st.sampled_from(KINDS),
    st.sampled_from(("full", "swa", "host")),
    st.sampled_from(("a", "b", "c", None)),
    st.integers(0, 2),
    st.integers(0, 4),
    st.integers(0, 2),
    slot_sets,
    st.sampled_from((None, "write", "load")),
)  # a lock's reason: a copy op's or not


def brute_broken(ledger: Ledger) -> bool:
    return bool(ledger.double_frees or ledger.stuck_ops or ledger.locks_of_ended_requests() or ledger.orphans())


def brute_orphaned_owners(ledger: Ledger) -> set[tuple[int, int]]:
    """Every (kind, ref) owning a slot in a pool scan, whose request ended, whose node is gone or
    whose host copy left the tree."""
    alive = {REQUEST: ledger.live, TREE: ledger.node_slots, HOST_COPY: ledger.host_copies}
    found = set()
    for pool in ledger.pools.values():
        for kind, ref in zip(pool.kind.tolist(), pool.ref.tolist(), strict=True):
            if kind != FREE and ref not in alive[kind]:
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
    if kind is EventKind.HOST_EVICT:
        held = ledger.host_copies.get(node)
        return None if held is None else held.tolist()
    if kind is EventKind.FREE and pool == "host":  # a host copy's free (it may have left the tree)
        host = ledger.pools["host"]
        return np.flatnonzero((host.kind == HOST_COPY) & (host.ref == node)).tolist()
    if kind is EventKind.FREE and rid is not None and rid in ledger.rid_index:
        pool_ledger = ledger.pools[pool]
        return np.flatnonzero((pool_ledger.kind == 1) & (pool_ledger.ref == ledger.rid_index[rid])).tolist()
    return None


@settings(max_examples=300, deadline=None)
@given(st.lists(events, min_size=20, max_size=60), st.integers(1, 5), st.data())
def test_per_step_verdict_equals_the_pool_scan(stream: list, check_every: int, data: st.DataObject) -> None:
    ledger = Ledger()
    for seq, (kind, pool, rid, node, num_tokens, aux, slots, reason) in enumerate(stream):
        owned = owned_slots(ledger, kind, pool, rid, node)
        if owned is not None and data.draw(st.booleans()):
            slots = owned
        ledger.apply(kind, seq // 3, seq, pool, rid, node, num_tokens, aux, np.array(slots, dtype=np.int64), reason)
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
    assert APPLY_COLUMNS == ("kind", "step", "seq", "pool", "rid", "node_id", "num_tokens", "aux", "slots", "reason")
    assert set(APPLY_COLUMNS) <= set(schema.EVENT_COLUMNS)


def host_ledger() -> Ledger:
    """Node 3 holds device slots [1, 2] and, written by op 7 (acknowledged), host slots [10, 11]."""
    ledger = Ledger()
    ledger.apply(EventKind.INSERT, 0, 0, "full", None, 3, 2, 0, np.array([1, 2]))
    ledger.apply(EventKind.ALLOC, 0, 1, "host", None, None, 2, 0, np.array([10, 11]))
    ledger.apply(EventKind.WRITE, 0, 2, "host", None, 3, 2, 7, np.array([10, 11]))
    ledger.apply(EventKind.LOCK, 0, 3, None, None, 3, 2, 7, None, "write")
    assert not ledger.is_broken(), "a copy lock is legitimate while its op is in flight"
    ledger.apply(EventKind.ACK, 1, 4, "host", None, 3, 2, 7, None)
    ledger.apply(EventKind.UNLOCK, 1, 5, None, None, 3, 2, 7, None, "write")
    assert not ledger.is_broken()
    return ledger


def test_a_host_copy_outlives_its_device_slots_and_orphans_its_slots_when_it_leaves_unfreed() -> None:
    ledger = host_ledger()
    ledger.apply(EventKind.EVICT, 2, 6, "full", None, 3, 2, 0, np.array([1, 2]))  # to-host
    ledger.apply(EventKind.FREE, 2, 7, "full", None, None, 2, 0, np.array([1, 2]))
    assert not ledger.is_broken(), "a host-only node is still in the tree"
    ledger.apply(EventKind.HOST_EVICT, 3, 8, "host", None, 3, 2, 0, np.array([10, 11]))
    assert ledger.is_broken()
    [hold] = ledger.orphans()
    assert (hold.pool, hold.slots, hold.node_id, hold.owner, hold.step, hold.gone_step) == (
        "host",
        [10, 11],
        3,
        HOST_COPY,
        0,
        3,
    )
    ledger.apply(EventKind.FREE, 3, 9, "host", None, None, 2, 0, np.array([10, 11]))
    assert not ledger.is_broken()
    ledger.apply(EventKind.FREE, 4, 10, "host", None, None, 2, 0, np.array([10, 11]))
    assert [(d.pool, d.slots, d.first_step) for d in ledger.double_frees] == [("host", [10, 11], 3)]
    ledger.check_integrity()


def test_a_split_gives_the_upper_node_the_head_of_the_host_copy_even_without_device_slots() -> None:
    ledger = host_ledger()
    ledger.apply(EventKind.EVICT, 2, 6, "full", None, 3, 2, 0, np.array([1, 2]))
    ledger.apply(EventKind.FREE, 2, 7, "full", None, None, 2, 0, np.array([1, 2]))
    ledger.apply(EventKind.SPLIT, 3, 8, None, None, 5, 1, 3, None)  # upper node 5 takes 1 token
    host = ledger.pools["host"]
    assert (host.ref[10], host.ref[11]) == (5, 3) and 5 not in ledger.node_slots
    ledger.apply(EventKind.HOST_EVICT, 4, 9, "host", None, 3, 1, 0, np.array([11]))
    ledger.apply(EventKind.FREE, 4, 10, "host", None, None, 1, 0, np.array([11]))
    assert not ledger.is_broken(), "node 5's host copy is still in the tree"
    ledger.apply(EventKind.HOST_EVICT, 5, 11, "host", None, 5, 1, 0, np.array([10]))
    assert [(h.node_id, h.slots) for h in ledger.orphans()] == [(5, [10])]
    ledger.check_integrity()


def test_a_copy_lock_after_its_ack_and_an_op_in_flight_at_an_idle_point_are_defects() -> None:
    ledger = host_ledger()
    ledger.apply(EventKind.LOAD, 2, 6, "full", None, 3, 2, 8, np.array([4, 5]))
    ledger.apply(EventKind.LOCK, 2, 7, None, None, 3, 2, 8, None, "load")
    assert not ledger.is_broken()
    ledger.apply(EventKind.ACK, 3, 8, "full", None, 3, 2, 8, None)
    assert ledger.is_broken() and [h.op for h in ledger.locks_of_ended_requests()] == [8]
    ledger.apply(EventKind.UNLOCK, 3, 9, None, None, 3, 2, 8, None, "load")
    assert not ledger.is_broken()
    ledger.apply(EventKind.WRITE, 4, 10, "host", None, 3, 2, 9, np.array([12, 13]))
    ledger.apply(EventKind.LEAK_CHECK, 5, 11, None, None, None, 0, 1, None)
    ledger.apply(EventKind.LEAK_CHECK, 5, 12, None, None, None, 0, 1, None)  # one per pool: reported once
    assert [(s.op, s.copy.kind, s.idle_step) for s in ledger.stuck_ops] == [(9, "write", 5)]
    assert ledger.is_broken()
    ledger.check_integrity()


def test_a_slot_listed_twice_in_one_move_is_counted_once() -> None:
    """The shrunk hypothesis example: swa slot 3 was behind full 8 (node 0), then behind full 9
    (node 2). The ledger remembered both peers, so one insert of [8, 9] reached swa 3 twice and
    the per-owner counts moved it twice while the pool moved it once. Now 8 loses its peer when
    9 takes it (and a slot reached twice would be counted once)."""
    ledger = Ledger()
    ledger.apply(EventKind.INSERT, 0, 0, "full", None, 0, 1, 0, np.array([8]))
    ledger.apply(EventKind.REVIVE, 0, 1, "full", None, 2, 1, 0, np.array([9]))
    ledger.apply(EventKind.REVIVE, 0, 2, "swa", None, 0, 1, 0, np.array([3]))
    ledger.apply(EventKind.REVIVE, 0, 3, "swa", None, 2, 1, 0, np.array([3]))
    ledger.apply(EventKind.INSERT, 1, 4, "full", None, 0, 2, 0, np.array([8, 9]))
    ledger.check_integrity()
    assert ledger.full_to_swa == {9: 3}
    swa = ledger.pools["swa"]
    assert (swa.kind[3], swa.ref[3]) == (TREE, 0)


def test_an_event_that_lists_a_slot_twice_keeps_the_counts_honest() -> None:
    """A buggy engine may hand out one slot twice in one allocation: the slot has one owner."""
    ledger = Ledger()
    ledger.apply(EventKind.REQUEST_ADMIT, 0, 0, None, "r", None, 0, 0, None)
    ledger.apply(EventKind.ALLOC, 0, 1, "full", "r", None, 2, 0, np.array([5, 5]))
    ledger.check_integrity()
    ledger.apply(EventKind.INSERT, 1, 2, "full", None, 4, 2, 0, np.array([5, 5]))
    ledger.check_integrity()
    ledger.apply(EventKind.SPLIT, 2, 3, None, None, 6, 1, 4, None)
    ledger.check_integrity()
    assert not ledger.is_broken()


def sliding_window_ledger() -> Ledger:
    """Request r's token at full slot 8 had SWA slot 3; it left the window (SWA half freed) and
    the allocator gave SWA slot 3 to r's next token, at full slot 9."""
    ledger = Ledger()
    ledger.apply(EventKind.REQUEST_ADMIT, 0, 0, None, "r", None, 0, 0, None)
    ledger.apply(EventKind.ALLOC, 0, 1, "full", "r", None, 1, 0, np.array([8]))
    ledger.apply(EventKind.ALLOC, 0, 2, "swa", "r", None, 1, 0, np.array([3]))
    ledger.apply(EventKind.FREE, 1, 3, "swa", "r", None, 1, 0, np.array([3]))
    ledger.apply(EventKind.ALLOC, 1, 4, "full", "r", None, 1, 0, np.array([9]))
    ledger.apply(EventKind.ALLOC, 1, 5, "swa", "r", None, 1, 0, np.array([3]))
    return ledger


def test_a_swa_slot_freed_out_of_the_window_is_no_longer_the_peer_of_its_old_full_slot() -> None:
    ledger = sliding_window_ledger()
    ledger.apply(EventKind.REQUEST_FINISH, 2, 6, None, "r", None, 0, 0, None)
    ledger.apply(EventKind.INSERT, 2, 7, "full", "r", 1, 1, 0, np.array([8]))  # the tombstoned part
    swa = ledger.pools["swa"]
    assert (swa.kind[3], swa.ref[3]) == (REQUEST, ledger.rid_index["r"]), "swa 3 is behind full 9, r's"
    ledger.apply(EventKind.INSERT, 2, 8, "full", "r", 2, 1, 0, np.array([9]))
    assert (swa.kind[3], swa.ref[3]) == (TREE, 2)
    ledger.apply(EventKind.EVICT, 3, 9, "full", None, 1, 1, 0, np.array([8]))
    ledger.apply(EventKind.FREE, 3, 10, "full", None, None, 1, 0, np.array([8]))
    assert not ledger.is_broken() and ledger.full_to_swa == {9: 3}
    ledger.check_integrity()
