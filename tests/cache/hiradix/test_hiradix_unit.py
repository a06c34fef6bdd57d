"""HiRadixCache, one behaviour per test, each with its paired control: write policies and the
write lock, demotion to the host tier, host hits in match_prefix, load_back (all or nothing,
its minimum, quota and eviction retry, K/V bytes intact), evict_host, the adopting insert,
write_back's drop, and the views. Every test ends with check_integrity and conservation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.cache import EvictParams, MatchResult
from kvscope.cache.hiradix import LOAD_BACK_MIN_TOKENS, HiMatchResult, HiRadixCache
from kvscope.mem import IntegrityError
from tests.cache.hiradix.helpers import (
    Tiers,
    alloc_seq,
    check_all,
    ids,
    insert_seq,
    make_tiers,
    node_of,
    read_device,
    write_random,
)
from tests.conftest import device_params

SEQ = np.arange(100, 116, dtype=np.int32)  # 16 tokens: above the load-back minimum


def evict_all(t: Tiers) -> None:
    t.controller.wait_all()  # NOTE: CUDA: copies finish on a side stream; acks stay queued
    t.cache.writing_check()
    t.cache.loading_check()
    t.cache.evict(EvictParams(t.cache.evictable_size()))


def test_write_through_backs_up_at_insert_and_locks_until_ack() -> None:
    t = make_tiers("write_through")
    insert_seq(t, SEQ)
    node = node_of(t, SEQ)
    assert node.tier == "device+host" and node.lock_ref == 1 and node.write_op is not None
    assert t.cache.protected_size() == 16 and t.cache.evictable_size() == 0
    check_all(t)
    assert t.cache.writing_check() != []
    assert node.lock_ref == 0 and node.write_op is None and t.cache.evictable_size() == 16
    check_all(t)


def test_write_back_and_selective_do_not_back_up_a_first_insert() -> None:
    for policy in ("write_back", "write_through_selective"):
        t = make_tiers(policy)  # type: ignore[arg-type]
        insert_seq(t, SEQ)
        node = node_of(t, SEQ)
        assert node.tier == "device" and node.lock_ref == 0 and t.cache.evictable_size() == 16
        assert t.host_allocator.available_size() == t.host_allocator.total_size
        check_all(t)


def test_selective_backs_up_on_second_insert_parent_first() -> None:
    t = make_tiers("write_through_selective")
    longer = np.concatenate((SEQ, np.arange(7, 11, dtype=np.int32)))
    insert_seq(t, SEQ)
    insert_seq(t, longer)  # SEQ hit twice: backed up; the new tail hit once: not
    assert node_of(t, SEQ).tier == "device+host"
    assert node_of(t, longer).tier == "device"
    t.cache.writing_check()
    insert_seq(t, longer)
    assert node_of(t, longer).tier == "device+host"
    t.cache.writing_check()
    check_all(t)


def test_backup_refused_under_a_parent_without_host_copy() -> None:
    t = make_tiers("write_through", host_tokens=20)
    insert_seq(t, SEQ)
    t.cache.writing_check()
    other = np.arange(300, 316, dtype=np.int32)
    insert_seq(t, other)  # 4 host slots left: too few for it
    assert node_of(t, other).tier == "device"
    tail = np.arange(4, dtype=np.int32)
    insert_seq(t, np.concatenate((other, tail)))  # the tail would fit, but its parent has no host copy
    assert node_of(t, np.concatenate((other, tail))).tier == "device"
    assert t.host_allocator.available_size() == 4
    insert_seq(t, np.concatenate((SEQ, tail)))  # the control: under a backed-up parent it is backed up
    assert node_of(t, np.concatenate((SEQ, tail))).tier == "device+host"
    assert t.host_allocator.available_size() == 0
    check_all(t)


def test_evict_demotes_backed_up_leaf_and_match_reports_host_hit() -> None:
    t = make_tiers("write_through")
    insert_seq(t, SEQ)
    assert t.cache.evictable_size() == 0
    with pytest.raises(ValueError):
        t.cache.evict(EvictParams(16))  # still locked by its write
    evict_all(t)
    node = node_of(t, SEQ)
    assert node.tier == "host" and node.value is None
    assert t.allocator.available_size() == t.allocator.total_size
    match = t.cache.match_prefix(SEQ)
    assert match.prefix_len == 0 and match.host_hit_length == 16 and match.last_node is t.cache.root
    check_all(t)


def test_evict_deletes_leaf_without_host_copy() -> None:
    t = make_tiers("write_through_selective")
    insert_seq(t, SEQ)
    evict_all(t)
    match = t.cache.match_prefix(SEQ)
    assert match.prefix_len == 0 and match.host_hit_length == 0 and not t.cache.root.children
    check_all(t)


def test_match_result_is_a_match_result() -> None:
    t = make_tiers()
    insert_seq(t, SEQ)
    match = t.cache.match_prefix(SEQ[:8])  # splits the node
    assert isinstance(match, MatchResult) and isinstance(match, HiMatchResult)
    slots, last = match
    assert match.prefix_len == 8 and len(slots) == 8 and last is match.last_node
    assert match.host_hit_length == 0
    check_all(t)


def test_match_splits_host_only_node_on_both_halves() -> None:
    t = make_tiers()
    insert_seq(t, SEQ)
    evict_all(t)
    host_before = t.cache.tree_host_slots().copy()
    match = t.cache.match_prefix(np.concatenate((SEQ[:8], [9, 9])).astype(np.int32))
    assert match.host_hit_length == 8 and match.prefix_len == 0
    upper = match.last_host_node
    assert upper.tier == "host" and len(upper.host_value) == 8
    assert np.array_equal(np.sort(t.cache.tree_host_slots()), np.sort(host_before))
    check_all(t)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("page_size", [1, 4])
def test_load_back_restores_kv_bytes(device: str, page_size: int) -> None:
    t = make_tiers("write_through", page_size=page_size, device=device)
    slots = t.allocator.alloc(16)
    assert slots is not None
    written = write_random(t, slots, seed=3)
    t.cache.insert(SEQ, slots)
    evict_all(t)
    # clobber the freed device rows so a load that copies nothing cannot pass
    write_random(t, slots, seed=4)
    match = t.cache.match_prefix(SEQ)
    loaded, last = t.cache.init_load_back(match.last_host_node, match.host_hit_length)
    assert len(loaded) == 16 and last.tier == "device+host" and last.lock_ref == 1
    t.controller.wait_all()
    for (k0, v0), (k1, v1) in zip(written, read_device(t, loaded), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    again = t.cache.match_prefix(SEQ)
    assert again.prefix_len == 16 and again.host_hit_length == 0 and torch.equal(again.device_indices, loaded)
    check_all(t)
    assert t.cache.loading_check() != [] and last.lock_ref == 0
    check_all(t)


def test_load_back_refuses_below_minimum_and_over_quota() -> None:
    t = make_tiers("write_through")
    short = np.arange(200, 200 + LOAD_BACK_MIN_TOKENS - 1, dtype=np.int32)
    exact = np.arange(400, 400 + LOAD_BACK_MIN_TOKENS, dtype=np.int32)
    insert_seq(t, short)
    insert_seq(t, exact)
    evict_all(t)
    assert t.cache.load_back(node_of(t, short)) is None  # one token short
    assert t.cache.load_back(node_of(t, exact), mem_quota=LOAD_BACK_MIN_TOKENS - 1) is None
    check_all(t)
    assert node_of(t, exact).tier == "host"
    loaded = t.cache.load_back(node_of(t, exact), mem_quota=LOAD_BACK_MIN_TOKENS)  # the control
    assert loaded is not None and len(loaded) == LOAD_BACK_MIN_TOKENS
    check_all(t)
    t.cache.loading_check()
    check_all(t)


def test_load_back_evicts_and_retries_once_on_device_oom() -> None:
    t = make_tiers("write_through", device_tokens=32)
    insert_seq(t, SEQ)
    evict_all(t)
    filler = np.arange(500, 532, dtype=np.int32)
    insert_seq(t, filler)  # the whole device pool, evictable once acked
    t.cache.writing_check()
    assert t.allocator.available_size() == 0
    loaded = t.cache.load_back(node_of(t, SEQ))
    assert loaded is not None and node_of(t, SEQ).tier == "device+host"
    check_all(t)


def test_load_back_fails_whole_when_device_is_locked_full() -> None:
    t = make_tiers("write_through", device_tokens=32)
    insert_seq(t, SEQ)
    evict_all(t)
    filler = np.arange(500, 532, dtype=np.int32)
    insert_seq(t, filler)  # its write lock holds the whole device pool
    assert t.cache.load_back(node_of(t, SEQ)) is None
    node = node_of(t, SEQ)
    assert node.tier == "host" and node.host_ref_counter == 0 and t.cache.num_in_flight() == 1
    check_all(t)


def test_evict_host_frees_unpinned_host_leaves_only() -> None:
    t = make_tiers("write_through")
    longer = np.concatenate((SEQ, np.arange(4, dtype=np.int32)))
    insert_seq(t, longer)
    other = np.arange(600, 616, dtype=np.int32)
    insert_seq(t, other)
    evict_all(t)
    t.cache.load_back(node_of(t, other))  # device+host again, locked until acked: not host-evictable
    leaves = t.cache.host_evictable_leaves()
    assert [n.key_len for n in leaves] == [20]
    freed = t.cache.evict_host(1)
    assert freed == 20 and t.cache.match_prefix(longer).host_hit_length == 0
    assert t.cache.evict_host(100) == 0  # the loaded node is device+host: out of evict_host's reach
    check_all(t)
    t.cache.loading_check()
    check_all(t)


def test_evict_host_skips_inner_host_nodes_until_their_children_go() -> None:
    t = make_tiers("write_through")
    a = np.concatenate((SEQ, [1, 2])).astype(np.int32)
    b = np.concatenate((SEQ, [3, 4])).astype(np.int32)
    insert_seq(t, a)
    insert_seq(t, b)
    evict_all(t)
    assert sorted(n.key_len for n in t.cache.host_evictable_leaves()) == [2, 2]
    assert t.cache.evict_host(4) == 4  # the two leaves; their parent became a leaf but 4 were enough
    assert t.cache.match_prefix(SEQ).host_hit_length == 16
    assert t.cache.evict_host(1) == 16
    assert not t.cache.root.children
    check_all(t)


def test_insert_adopts_fully_covered_host_node_without_counting_it() -> None:
    t = make_tiers("write_through")
    insert_seq(t, SEQ)
    evict_all(t)
    host_slots = node_of(t, SEQ).host_value.copy()
    result = insert_seq(t, SEQ)  # recompute: the caller frees only [0, prefix_len)
    assert result is not None
    prefix_len, slots = result
    node = node_of(t, SEQ)
    assert prefix_len == 0 and node.tier == "device+host"
    assert np.array_equal(node.value, slots.numpy()) and np.array_equal(node.host_value, host_slots)
    assert t.cache.evictable_size() == 16
    check_all(t)


def test_insert_partly_covering_host_node_adopts_the_upper_half() -> None:
    t = make_tiers("write_through")
    insert_seq(t, SEQ)
    evict_all(t)
    result = insert_seq(t, SEQ[:8])
    assert result is not None and result[0] == 0
    match = t.cache.match_prefix(SEQ)
    assert match.prefix_len == 8 and match.host_hit_length == 8
    check_all(t)


def test_device_prefix_before_host_node_is_counted() -> None:
    t = make_tiers("write_through")
    longer = np.concatenate((SEQ, np.arange(8, dtype=np.int32)))
    insert_seq(t, SEQ)
    t.cache.writing_check()
    insert_seq(t, longer)
    t.cache.writing_check()
    t.cache.inc_lock_ref(node_of(t, SEQ))
    t.cache.evict(EvictParams(t.cache.evictable_size()))  # only the tail goes to the host
    assert t.cache.match_prefix(longer).host_hit_length == 8
    result = insert_seq(t, longer)
    assert result is not None and result[0] == 16  # the device prefix only
    assert t.cache.match_prefix(longer).prefix_len == 24
    t.cache.dec_lock_ref(node_of(t, SEQ))
    check_all(t)


def test_write_back_writes_on_eviction_with_bytes_intact() -> None:
    t = make_tiers("write_back")
    slots = t.allocator.alloc(16)
    assert slots is not None
    written = write_random(t, slots, seed=5)
    t.cache.insert(SEQ, slots)
    t.cache.evict(EvictParams(16))
    node = node_of(t, SEQ)
    assert node.tier == "host" and t.cache.num_in_flight() == 0 and t.cache.num_dropped_tokens == 0
    for layer, (k0, v0) in enumerate(written):
        hk, hv = t.host_kv.get_kv_buffer(layer)
        idx = torch.from_numpy(node.host_value)
        assert torch.equal(hk[idx], k0) and torch.equal(hv[idx], v0)
    check_all(t)


def test_write_back_drops_subtree_the_host_cannot_take() -> None:
    t = make_tiers("write_back", host_tokens=12)
    longer = np.concatenate((SEQ, np.arange(4, dtype=np.int32)))
    insert_seq(t, SEQ)
    insert_seq(t, longer)
    t.cache.evict(EvictParams(4))  # the 4-token tail is written back
    assert t.cache.match_prefix(longer).host_hit_length == 4
    t.cache.evict(EvictParams(16))  # 16 host tokens: evict_host frees the tail's 4, still short: dropped
    assert t.cache.num_dropped_tokens == 16 and not t.cache.root.children
    check_all(t)
    control = make_tiers("write_back", host_tokens=20)
    insert_seq(control, SEQ)
    insert_seq(control, longer)
    control.cache.evict(EvictParams(4))
    control.cache.evict(EvictParams(16))
    assert control.cache.num_dropped_tokens == 0
    assert control.cache.match_prefix(longer).host_hit_length == 20
    check_all(control)


def test_write_back_keeps_the_host_copy_of_a_leaf_it_just_wrote_when_a_later_leaf_needs_room() -> None:
    """SGLang 0.5.18 pins a leaf written during a write_back eviction until its flush: the next
    leaf's write finds the host full, evicts no pinned copy, and is dropped instead (found by
    tests/engines/test_hiradix_sglang_differential.py; unpinned, the first copy was freed)."""
    t = make_tiers("write_back", host_tokens=8)
    first, second = ids(1, 2, 3, 4, 5, 6), ids(9, 8, 7, 6, 5, 4)
    insert_seq(t, first)
    insert_seq(t, second)
    assert t.cache.evict(EvictParams(12)).num_tokens_evicted == 12  # first written (6 of 8), second dropped
    assert t.cache.match_prefix(first).host_hit_length == 6
    assert t.cache.match_prefix(second).host_hit_length == 0 and t.cache.num_dropped_tokens == 6
    check_all(t)


def test_check_integrity_catches_a_host_slot_leak_and_a_broken_closure() -> None:
    t = make_tiers("write_through")
    insert_seq(t, SEQ)
    evict_all(t)
    node = node_of(t, SEQ)
    node.host_value = node.host_value[:8]
    with pytest.raises(IntegrityError):
        t.cache.check_integrity()
    u = make_tiers("write_through")
    insert_seq(u, SEQ)
    u.cache.writing_check()
    node = node_of(u, SEQ)
    child = node_of(u, SEQ[:8])  # split: the upper half is the parent
    child.value, saved = None, child.value
    with pytest.raises(IntegrityError):
        u.cache.check_integrity()
    child.value = saved
    u.cache.check_integrity()


def test_views_show_each_tier() -> None:
    t = make_tiers("write_through")
    insert_seq(t, SEQ)
    evict_all(t)
    insert_seq(t, np.arange(700, 708, dtype=np.int32))
    text = t.cache.pretty_print()
    assert " hits=1 host: " in text and " device+host writing=" in text  # each node names its tier
    rows = t.cache.export_nodes()
    assert sorted(r.num_tokens for r in rows) == [0, 8, 16]
    assert all(r.depth_tokens == r.num_tokens for r in rows)
    check_all(t)


def test_bad_construction_is_refused() -> None:
    t = make_tiers()
    with pytest.raises(ValueError):
        HiRadixCache(t.allocator, 1, t.controller, write_policy="write_sometimes")  # type: ignore[arg-type]


def test_a_split_makes_a_new_upper_node_created_then_and_an_insert_raises_both_pieces_priority() -> None:
    """The upper piece is new, as in the radix tree; but SGLang 0.5.18's HiRadixCache.insert raises
    the node's priority before it splits it, so both pieces keep the raised one (its RadixCache
    raises only the upper piece's; tests/engines/test_hiradix_sglang_differential.py found it)."""
    t = make_tiers()
    slots = alloc_seq(t, 4)
    assert slots is not None
    t.cache.insert(ids(1, 2, 3, 4), slots)
    first = node_of(t, ids(1, 2, 3, 4))
    first.creation_time = 1.0
    more = alloc_seq(t, 4)
    assert more is not None
    t.allocator.free(more[: t.cache.insert(ids(1, 2, 7, 8), more, priority=5)])
    upper = first.parent
    assert upper is not None and upper is not t.cache.root
    assert (first.creation_time, first.priority) == (1.0, 5)
    assert upper.creation_time > 1.0 and upper.priority == 5
    check_all(t)


def test_an_evicted_leaf_frees_its_pages_sorted_as_sglangs_allocator_free_does() -> None:
    """Page size 2: a leaf whose rows hold page y then page x (y > x) gives back [x, y] in front of the
    free list, as SGLang 0.5.18's HiRadixCache frees each leaf with allocator.free (unique pages)."""
    t = make_tiers(page_size=2)
    low, high = alloc_seq(t, 2), alloc_seq(t, 2)
    assert low is not None and high is not None
    x, y = int(low[0]) // 2, int(high[0]) // 2
    assert x < y
    t.cache.insert(ids(1, 2, 3, 4), torch.cat([high, low]))  # NOTE: rows in page order y, x
    t.controller.wait_all()  # NOTE: write_through: the copy to the host holds the leaf until acknowledged
    t.cache.writing_check()
    t.cache.evict(EvictParams(4))
    assert t.allocator.free_pages[:2].tolist() == [x, y]
    check_all(t)


def test_write_back_frees_the_leaves_it_wrote_during_an_eviction_last() -> None:
    """SGLang 0.5.18's write_back eviction frees a leaf it writes to the host only once the copies are
    done (its flush_staged, at the end), while a leaf that already had a host copy is freed at once:
    with the older leaf written and the newer one demoted, the demoted leaf's slots come back first."""
    t = make_tiers("write_back", device_tokens=32)
    demoted = ids(*range(100, 112))  # NOTE: at least LOAD_BACK_MIN_TOKENS, to load it back
    inserted = insert_seq(t, demoted)
    assert inserted is not None
    t.cache.evict(EvictParams(12))  # written to the host, host-only now
    written = insert_seq(t, ids(1, 2, 3, 4))
    assert written is not None
    match = t.cache.match_prefix(demoted)  # NOTE: after the insert: the demoted leaf is the newer one
    loaded, last = t.cache.init_load_back(match.last_host_node, match.host_hit_length)
    assert len(loaded) == 12 and last.tier == "device+host"
    t.controller.wait_all()
    t.cache.loading_check()
    assert t.cache.evict(EvictParams(16)).num_tokens_evicted == 16
    assert t.allocator.free_pages[-16:].tolist() == loaded.tolist() + written[1].tolist()
    check_all(t)
