"""What the two-tier cache tells the recorder: the write / load / ack / host_evict events, the
evict reasons to-host and drop, copy locks named by their op, the host allocator's allocs and
frees, and tree snapshots with each node's tier.

The state machine of test_hiradix_properties runs again with a recorder attached; after every
step the events must account for the cache exactly: replaying them onto the first snapshot
gives the node table the cache exports now (tiers and locks included), the tokens written and
loaded add up, the ops in flight are those without an ack, and every copy lock is held by an
op still in flight.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import settings
from hypothesis.stateful import invariant

from kvscope.cache import EvictParams
from kvscope.telemetry import CopyKind, Event, EventKind, EvictReason, ListRecorder, NodeRow, PoolName, replay_tree
from tests.cache.hiradix.helpers import Tiers, check_all, insert_seq, make_tiers, node_of
from tests.cache.hiradix.test_hiradix_properties import HiRadixMachine

SEQ = np.arange(100, 116, dtype=np.int32)
COMPARED = ["node_id", "parent_id", "num_tokens", "lock_ref", "tier"]


def recorded(t: Tiers) -> ListRecorder:
    recorder = ListRecorder()
    t.cache.recorder = recorder
    t.host_allocator.recorder = recorder
    t.allocator.recorder = recorder  # type: ignore[attr-defined]
    return recorder


def events_frame(events: list[Event]) -> pd.DataFrame:
    frame = pd.DataFrame(events, columns=list(Event._fields))
    frame["t_mono"] = 0.0
    return frame


def node_table(rows: list[NodeRow]) -> pd.DataFrame:
    table = pd.DataFrame(rows, columns=list(NodeRow._fields))
    return table[COMPARED].astype({"parent_id": "Int64"}).sort_values("node_id").reset_index(drop=True)


def kinds(recorder: ListRecorder) -> list[tuple[str, str | None, Any]]:
    return [
        (e.kind.value, e.pool and e.pool.value, e.reason and e.reason.value)
        for e in recorder.events
        if e.kind not in (EventKind.MATCH, EventKind.SPLIT)
    ]


def test_write_through_records_alloc_write_and_a_copy_lock_until_the_ack() -> None:
    t = make_tiers("write_through")
    recorder = recorded(t)
    insert_seq(t, SEQ)
    write = recorder.of_kind(EventKind.WRITE)[0]
    node = node_of(t, SEQ)
    assert (write.pool, write.node_id, write.num_tokens) == (PoolName.HOST, node.id, 16)
    assert write.slots == node.host_value.tolist() and write.aux == node.write_op
    host_alloc = [e for e in recorder.of_kind(EventKind.ALLOC) if e.pool is PoolName.HOST]
    assert len(host_alloc) == 1 and host_alloc[0].slots == write.slots and host_alloc[0].rid is None
    lock = recorder.of_kind(EventKind.LOCK)[-1]
    assert (lock.rid, lock.node_id, lock.reason, lock.aux) == (None, node.id, CopyKind.WRITE, write.aux)  # the op's
    t.cache.writing_check()
    ack, unlock = recorder.of_kind(EventKind.ACK)[0], recorder.of_kind(EventKind.UNLOCK)[-1]
    assert (ack.pool, ack.reason, ack.node_id, ack.num_tokens, ack.aux) == (
        PoolName.HOST,
        CopyKind.WRITE,
        node.id,
        16,
        write.aux,
    )
    assert (unlock.node_id, unlock.reason, unlock.aux) == (node.id, CopyKind.WRITE, write.aux)
    assert recorder.events.index(ack) < recorder.events.index(unlock)
    check_all(t)


def test_eviction_to_host_load_back_and_host_eviction_are_recorded_with_their_tier() -> None:
    t = make_tiers("write_through")
    recorder = recorded(t)
    insert_seq(t, SEQ)
    t.cache.writing_check()
    node = node_of(t, SEQ)
    device_slots = node.value.tolist()
    t.cache.evict(EvictParams(16))
    evict = recorder.of_kind(EventKind.EVICT)[-1]
    assert (evict.pool, evict.reason, evict.node_id, evict.slots) == (
        PoolName.FULL,
        EvictReason.TO_HOST,
        node.id,
        device_slots,
    )
    assert t.cache.export_nodes()[-1].tier == "host"
    match = t.cache.match_prefix(SEQ)
    loaded = t.cache.load_back(match.last_host_node)
    assert loaded is not None
    load = recorder.of_kind(EventKind.LOAD)[-1]
    assert (load.pool, load.node_id, load.num_tokens, load.slots) == (PoolName.FULL, node.id, 16, loaded.tolist())
    revive = recorder.of_kind(EventKind.REVIVE)[-1]
    assert (revive.node_id, revive.slots) == (node.id, loaded.tolist())
    lock = recorder.of_kind(EventKind.LOCK)[-1]
    assert (lock.rid, lock.reason, lock.aux) == (None, CopyKind.LOAD, load.aux)
    t.cache.loading_check()
    ack = recorder.of_kind(EventKind.ACK)[-1]
    assert (ack.pool, ack.reason, ack.aux, ack.num_tokens) == (PoolName.FULL, CopyKind.LOAD, load.aux, 16)
    t.cache.evict(EvictParams(16))  # back to host-only, then off the host
    host_slots = node.host_value.tolist()
    assert t.cache.evict_host(16) == 16
    host_evict = recorder.of_kind(EventKind.HOST_EVICT)[-1]
    assert (host_evict.pool, host_evict.reason, host_evict.node_id, host_evict.slots) == (
        PoolName.HOST,
        EvictReason.CAPACITY,
        node.id,
        host_slots,
    )
    free = recorder.events[recorder.events.index(host_evict) + 1]
    assert (free.kind, free.pool, free.slots) == (EventKind.FREE, PoolName.HOST, host_slots)
    check_all(t)


def test_write_back_drop_is_an_evict_with_reason_drop_and_host_evicts_below() -> None:
    t = make_tiers("write_back", host_tokens=12)
    recorder = recorded(t)
    longer = np.concatenate((SEQ, np.arange(4, dtype=np.int32)))
    insert_seq(t, SEQ)
    insert_seq(t, longer)
    t.cache.evict(EvictParams(4))  # the tail is written back, synchronously, and demoted
    assert [k for k in kinds(recorder) if k[0] in ("write", "ack", "evict")] == [
        ("write", "host", None),
        ("evict", "full", "to-host"),
        ("ack", "host", "write"),
    ]
    tail = recorder.of_kind(EventKind.WRITE)[-1].node_id
    recorder.events.clear()
    t.cache.evict(EvictParams(16))  # the host makes room by evicting the tail, still too little: SEQ is dropped
    assert [(e.node_id, e.reason) for e in recorder.of_kind(EventKind.HOST_EVICT)] == [(tail, EvictReason.CAPACITY)]
    evict = recorder.of_kind(EventKind.EVICT)[-1]
    assert (evict.reason, evict.num_tokens) == (EvictReason.DROP, 16)
    assert t.cache.num_dropped_tokens == 16
    # control: the same run with room on the host drops nothing
    control = make_tiers("write_back", host_tokens=20)
    control_recorder = recorded(control)
    insert_seq(control, SEQ)
    insert_seq(control, longer)
    control.cache.evict(EvictParams(4))
    control.cache.evict(EvictParams(16))
    assert EvictReason.DROP not in {e.reason for e in control_recorder.of_kind(EventKind.EVICT)}
    check_all(t)
    check_all(control)


class RecordedMachine(HiRadixMachine):
    """HiRadixMachine with a recorder: the events must account for the cache after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.recorder = recorded(self.t)
        self.first = self.cache.export_nodes()

    @invariant()
    def replaying_the_events_gives_the_cache_as_it_is(self) -> None:
        snapshot = pd.DataFrame(self.first, columns=list(NodeRow._fields))
        replayed = replay_tree(snapshot, events_frame(self.recorder.events))
        expected = node_table(self.cache.export_nodes())
        got = replayed[COMPARED].sort_values("node_id").reset_index(drop=True)
        pd.testing.assert_frame_equal(got, expected, check_dtype=False)

    @invariant()
    def copies_add_up(self) -> None:
        events = self.recorder.events
        assert sum(e.num_tokens for e in events if e.kind is EventKind.WRITE) == self.cache.num_write_tokens
        assert sum(e.num_tokens for e in events if e.kind is EventKind.LOAD) == self.cache.num_load_back_tokens
        host = Counter()
        for e in events:
            if e.pool is PoolName.HOST and e.kind in (EventKind.ALLOC, EventKind.FREE):
                host[e.kind] += e.num_tokens
        host_allocator = self.t.host_allocator
        host_used = host_allocator.total_size - host_allocator.available_size()
        assert host[EventKind.ALLOC] - host[EventKind.FREE] == host_used

    @invariant()
    def copy_locks_belong_to_ops_in_flight(self) -> None:
        started = {e.aux for e in self.recorder.events if e.kind in (EventKind.WRITE, EventKind.LOAD)}
        acked = {e.aux for e in self.recorder.of_kind(EventKind.ACK)}
        assert acked <= started
        assert len(started - acked) == self.cache.num_in_flight()
        held = Counter()
        for e in self.recorder.events:
            if e.kind in (EventKind.LOCK, EventKind.UNLOCK) and e.reason is not None:
                assert e.rid is None and e.aux
                held[e.aux] += 1 if e.kind is EventKind.LOCK else -1
        assert all(count in (0, 1) for count in held.values())
        assert {op for op, count in held.items() if count} <= started - acked


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_events_account_for_the_two_tier_cache(policy: str, page_size: int) -> None:
    machine = type(f"Recorded_{policy}_{page_size}", (RecordedMachine,), {"policy": policy, "page_size": page_size})
    machine.TestCase.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)
    machine.TestCase("runTest").runTest()
