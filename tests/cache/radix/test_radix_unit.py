"""RadixCache on hand-built trees: eviction orders, page-granular eviction, misuse errors,
telemetry events, the flat export."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.cache import CacheMisuseError, EvictParams, RadixCache
from kvscope.mem import ReqToTokenPool, make_token_allocator
from kvscope.telemetry import EventKind, EvictReason, ListRecorder
from tests.cache.helpers import Req, ids

# leaf: (first token, last_access_time, hit_count, creation_time, priority)
LEAVES = {"a": (1, 40.0, 3, 1.0, 5), "b": (2, 10.0, 9, 4.0, 1), "c": (3, 30.0, 1, 2.0, 1), "d": (4, 20.0, 3, 3.0, 9)}
EXPECTED = {
    "lru": "bdca",  # last access ascending
    "lfu": "cdab",  # (hits, last access)
    "fifo": "acdb",  # creation ascending
    "mru": "acdb",  # last access descending
    "filo": "bdca",  # creation descending
    "priority": "bcad",  # (priority, last access)
}


def build(policy: str, recorder: ListRecorder | None = None) -> tuple[RadixCache, dict[int, str]]:
    allocator = make_token_allocator(64, 1)
    cache = RadixCache(allocator, 1, eviction_policy=policy, **({"recorder": recorder} if recorder else {}))
    names = {}
    for name, (token, access, hits, created, priority) in LEAVES.items():
        slots = allocator.alloc(2)
        assert slots is not None
        cache.insert(ids(token, token), slots)
        node = cache.root.children[ids(token).tobytes()]
        node.last_access_time, node.hit_count, node.creation_time, node.priority = access, hits, created, priority
        names[node.id] = name
    cache.refresh_eviction_order()
    return cache, names


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_each_policy_evicts_in_its_documented_order(policy: str) -> None:
    recorder = ListRecorder()
    cache, names = build(policy, recorder)
    for _ in LEAVES:
        assert cache.evict(EvictParams(1)).num_tokens_evicted == 2
        cache.check_integrity()
    order = "".join(names[e.node_id] for e in recorder.of_kind(EventKind.EVICT))
    assert order == EXPECTED[policy]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(CacheMisuseError, match="unknown eviction policy 'random'"):
        RadixCache(make_token_allocator(8, 1), 1, eviction_policy="random")


def test_page_granular_eviction_trims_the_coldest_leaf_tail() -> None:
    allocator = make_token_allocator(64, 4)
    cache = RadixCache(allocator, 4, eviction_granularity="page")
    cold = allocator.alloc(12)
    warm = allocator.alloc(8)
    assert cold is not None and warm is not None
    cache.insert(np.arange(12, dtype=np.int32), cold)
    cache.insert(np.arange(100, 108, dtype=np.int32), warm)
    assert cache.evict(EvictParams(3)).num_tokens_evicted == 4, "one page, not the whole 12-token leaf"
    assert cache.match_prefix(np.arange(12, dtype=np.int32)).prefix_len == 8
    assert cache.evictable_size() == 16
    cache.check_integrity()
    allocator.check_integrity(cache.tree_slots())
    # that match made the first leaf the warmer one: the 8-token leaf goes whole, then one page
    assert cache.evict(EvictParams(9)).num_tokens_evicted == 12
    assert cache.match_prefix(np.arange(100, 108, dtype=np.int32)).prefix_len == 0
    assert cache.match_prefix(np.arange(12, dtype=np.int32)).prefix_len == 4


def test_page_granular_ties_go_to_the_deeper_leaf() -> None:
    allocator = make_token_allocator(64, 2)
    cache = RadixCache(allocator, 2, eviction_granularity="page")
    shallow, deep = allocator.alloc(4), allocator.alloc(8)
    assert shallow is not None and deep is not None
    cache.insert(ids(9, 9, 9, 9), shallow)
    cache.insert(ids(1, 1, 2, 2, 3, 3, 4, 4), deep)
    for node in cache.root.children.values():
        node.last_access_time = 5.0
    cache.refresh_eviction_order()
    cache.evict(EvictParams(2))
    assert cache.match_prefix(ids(1, 1, 2, 2, 3, 3, 4, 4)).prefix_len == 6
    assert cache.match_prefix(ids(9, 9, 9, 9)).prefix_len == 4


def test_whole_leaf_eviction_overshoots_as_sglang_does() -> None:
    cache, _ = build("lru")
    assert cache.evict(EvictParams(1)).num_tokens_evicted == 2


def test_misuse_errors_state_the_numbers() -> None:
    allocator = make_token_allocator(32, 1)
    cache = RadixCache(allocator, 1, strict=True)
    slots = allocator.alloc(4)
    assert slots is not None
    with pytest.raises(CacheMisuseError, match="4 token ids but 3 slots"):
        cache.insert(ids(1, 2, 3, 4), slots[:3])
    cache.insert(ids(1, 2, 3, 4), slots)
    with pytest.raises(CacheMisuseError, match=r"evict\(5, swa 0\) beyond the evictable size 4"):
        cache.evict(EvictParams(5))
    with pytest.raises(CacheMisuseError, match=r"evict\(1, swa 1\) .* holds no SWA KV"):
        cache.evict(EvictParams(1, swa_num_tokens=1))
    assert cache.evictable_size() == 4, "a refused evict frees nothing"
    node = cache.match_prefix(ids(1, 2, 3, 4)).last_node
    with pytest.raises(CacheMisuseError, match=f"node {node.id}, which is not locked"):
        cache.dec_lock_ref(node)
    with pytest.raises(CacheMisuseError, match=r"slots already in the tree inserted again: \[1\]"):
        cache.insert(ids(7, 8), torch.tensor([1, 9]))


def test_locks_move_tokens_between_evictable_and_protected() -> None:
    allocator = make_token_allocator(32, 1)
    cache = RadixCache(allocator, 1)
    cache.insert(ids(1, 2, 3, 4), allocator.alloc(4))  # type: ignore[arg-type]
    cache.insert(ids(1, 2, 7), allocator.alloc(3)[[0, 1, 2]])  # type: ignore[index]
    leaf = cache.match_prefix(ids(1, 2, 3, 4)).last_node
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    cache.inc_lock_ref(leaf)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.inc_lock_ref(leaf)
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    cache.dec_lock_ref(leaf)
    cache.dec_lock_ref(leaf)
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    assert cache.root.lock_ref == 1


def test_every_operation_reports_to_the_recorder() -> None:
    recorder = ListRecorder()
    allocator = make_token_allocator(32, 1)
    cache = RadixCache(allocator, 1, recorder=recorder)
    first = allocator.alloc(4)
    cache.insert(ids(1, 2, 3, 4), first, user="alice", rid="r1")  # type: ignore[arg-type]
    match = cache.match_prefix(ids(1, 2, 9), rid="r2")
    cache.inc_lock_ref(match.last_node)
    cache.dec_lock_ref(match.last_node)
    cache.evict(EvictParams(2))
    kinds = [e.kind for e in recorder.events]
    assert kinds == [
        EventKind.INSERT,
        EventKind.SPLIT,
        EventKind.MATCH,
        EventKind.CROSS_HIT,
        EventKind.LOCK,
        EventKind.UNLOCK,
        EventKind.EVICT,
    ]  # cross_hit: no requester named, alice's tokens reused
    insert, split, found, cross, lock, _, evict = recorder.events
    assert (cross.num_tokens, cross.node_id, cross.principal) == (2, split.node_id, None)
    assert (insert.rid, insert.num_tokens, insert.slots) == ("r1", 4, first.tolist())  # type: ignore[union-attr]
    assert insert.principal == "alice", "an insert event names the new node's owner"
    assert (found.num_tokens, found.aux, found.node_id) == (2, 1, split.node_id)
    assert lock.num_tokens == 2
    assert (evict.reason, evict.num_tokens) == (EvictReason.CAPACITY, 2)


def test_no_recorder_records_nothing_and_costs_a_flag() -> None:
    cache = RadixCache(make_token_allocator(8, 1), 1)
    assert cache.recorder.enabled is False


def test_export_and_pretty_print_show_the_tree() -> None:
    allocator = make_token_allocator(32, 1)
    cache = RadixCache(allocator, 1)
    cache.insert(ids(1, 2, 3, 4), allocator.alloc(4), user="alice")  # type: ignore[arg-type]
    cache.insert(ids(1, 2, 7), allocator.alloc(3), user="bob")  # type: ignore[arg-type]
    rows = {r.token_preview: r for r in cache.export_nodes(preview_tokens=2)}
    assert set(rows) == {"", "1 2", "3 4", "7"}
    assert rows["3 4"].depth_tokens == 4 and rows["3 4"].owner == "alice" and rows["7"].owner == "bob"
    assert rows["3 4"].parent_id == rows["1 2"].node_id
    assert rows["1 2"].hit_count == 2 and rows["1 2"].owner == "alice"
    text = cache.pretty_print()
    assert "2 tok" in text and "7" in text and text.startswith("root")


def test_cache_finished_req_never_inserts_the_last_token_and_frees_the_tail() -> None:
    allocator = make_token_allocator(64, 4, strict=True)
    rows = ReqToTokenPool(2, 64)
    cache = RadixCache(allocator, 4, req_to_token_pool=rows, strict=True)
    req = Req("r1", np.arange(11, dtype=np.int32), kv_committed_len=10, last_node=cache.root)
    rows.alloc([req])
    slots = allocator.alloc_extend([0], [10], [-1], 10)  # type: ignore[attr-defined]
    rows.write(req.req_pool_idx, 0, slots)  # type: ignore[arg-type]
    cache.cache_finished_req(req)
    assert cache.total_size() == 8, "10 tokens with KV, page-floored; token 10 has none"
    assert allocator.available_size() == 64 - 8
    allocator.check_integrity(cache.tree_slots())


def test_mru_evicts_a_parent_that_became_a_leaf_during_the_same_call() -> None:
    """SGLang pushes the parent onto the heap at once; found against sglang 0.5.18."""
    allocator = make_token_allocator(32, 1)
    cache = RadixCache(allocator, 1, eviction_policy="mru")
    for seq in ((9, 9), (1, 2, 3, 4), (1, 2, 5, 6)):
        cache.insert(ids(*seq), allocator.alloc(len(seq)))  # type: ignore[arg-type]
    cache.evict(EvictParams(5))
    assert cache.match_prefix(ids(1, 2)).prefix_len == 0
    assert cache.match_prefix(ids(9, 9)).prefix_len == 2


def test_paged_eviction_returns_pages_in_row_order_as_sglang() -> None:
    """SGLang 0.5.18 frees an evicted leaf with free_segment: pages in row order, unsorted."""
    allocator = make_token_allocator(16, 2)
    cache = RadixCache(allocator, 2)
    first = allocator.alloc(4)
    assert first is not None and first.tolist() == [2, 3, 4, 5]
    allocator.free(first[:2])
    allocator.free(first[2:])
    slots = allocator.alloc(4)
    assert slots is not None and slots.tolist() == [4, 5, 2, 3]
    cache.insert(ids(7, 8, 9, 10), slots)
    cache.evict(EvictParams(4))
    again = allocator.alloc(4)
    assert again is not None and again.tolist() == [4, 5, 2, 3]


def test_a_split_makes_a_new_upper_node_created_then_and_an_insert_raises_only_its_priority() -> None:
    """SGLang 0.5.23's `_split_node` makes the upper piece a new TreeNode (creation_time: the split),
    and its insert raises the priority of the upper piece only: fifo / filo and priority eviction see
    the lower piece as it was."""
    allocator = make_token_allocator(32, 1)
    cache = RadixCache(allocator, 1, eviction_policy="fifo")
    cache.insert(ids(1, 2, 3, 4), allocator.alloc(4))  # type: ignore[arg-type]
    first = cache.root.children[ids(1).tobytes()]
    first.creation_time = first.last_access_time = 1.0
    cache.insert(ids(1, 2, 7, 8), allocator.alloc(4), priority=5)  # type: ignore[arg-type]
    upper = cache.root.children[ids(1).tobytes()]
    lower = upper.children[ids(3).tobytes()]
    assert lower is first and (lower.creation_time, lower.priority) == (1.0, 0)
    assert upper.creation_time > 1.0 and upper.creation_time == upper.last_access_time and upper.priority == 5
    cache.check_integrity()
    cache.match_prefix(ids(1, 2, 3, 9))  # NOTE: a match splits [3, 4] at 3: its upper piece is new too
    assert lower.parent is not None and lower.parent.creation_time > 1.0 and lower.creation_time == 1.0
    cache.check_integrity()
