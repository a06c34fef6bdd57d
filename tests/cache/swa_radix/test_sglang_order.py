"""SWARadixCache evicts the nodes SGLang 0.5.18's SWARadixCache evicts and hands slots back in
its order (docs/memory-semantics.md §5). Each expectation is derived from SGLang 0.5.18's
python/sglang/srt/mem_cache/swa_radix_cache.py, function named in the test."""

from __future__ import annotations

import torch

from kvscope.cache import EvictParams, EvictResult
from kvscope.cache.swa_radix import SWARadixCache
from kvscope.cache.tree import walk
from tests.cache.helpers import ids
from tests.cache.swa_radix.test_swa_radix import insert_fresh, make_cache


def keys(cache: SWARadixCache) -> list[list[int]]:
    """Every node's tokens, depth first."""
    return sorted(
        [int(t) for t in torch.frombuffer(bytearray(n.key), dtype=torch.int32)]
        for n, _, _ in walk(cache.root)
        if n is not cache.root
    )


def test_a_match_refreshes_only_the_path_to_its_window_cut() -> None:
    # SGLang: _match_post_processor resets the LRU position of best_last_node and its parents,
    # not of the nodes walked past the cut.
    cache, _ = make_cache(window_len=5)
    insert_fresh(cache, ids(*range(1, 9)))  # X = [1..8]
    insert_fresh(cache, ids(*range(1, 13)))  # Y = [9..12] under X
    insert_fresh(cache, ids(50, 51, 52, 53))  # Z, newer than Y
    assert cache.evict(EvictParams(0, swa_num_tokens=1)) == EvictResult(0, 8), "X tombstoned"
    hit = cache.match_prefix(ids(*range(1, 13)))
    assert (hit.prefix_len, hit.last_node) == (0, cache.root), "4 live tokens past X: cut at the root"
    cache.evict(EvictParams(0, swa_num_tokens=1))  # Y is now the oldest live node, not Z
    assert keys(cache) == [[50, 51, 52, 53]]
    cache.check_integrity()


def test_an_insert_that_splits_a_node_leaves_the_upper_piece_oldest() -> None:
    # SGLang: _insert_helper moves each walked node to the front, then _split_node inserts the
    # upper and then the lower piece at the front, then _add_new_node the new leaf.
    cache, allocator = make_cache(window_len=4, full_pages=64, swa_pages=64)
    insert_fresh(cache, ids(*range(1, 9), *range(11, 19)))
    insert_fresh(cache, ids(*range(1, 9), *range(21, 29)))
    full_before = allocator.full_available_size()
    assert cache.evict(EvictParams(0, swa_num_tokens=1)) == EvictResult(0, 8), "the upper piece is tombstoned"
    assert allocator.full_available_size() == full_before
    upper = cache.root.children[ids(1).tobytes()]
    assert upper.tombstone and len(upper.children) == 2
    cache.check_integrity()


def paged_cache() -> tuple[SWARadixCache, torch.Tensor, torch.Tensor]:
    """Page size 2, pages 1-2 in `early`, pages 3-6 in `late`."""
    cache, allocator = make_cache(page_size=2, window_len=2)
    early, late = allocator.alloc(4), allocator.alloc(8)
    assert early is not None and late is not None
    return cache, early, late


def test_an_eviction_cascade_frees_the_leaf_then_each_tombstone_parent() -> None:
    # SGLang: evict() frees the leaf's value, then _iteratively_delete_tombstone_leaf frees each
    # parent with its own free(); each paged free puts its sorted pages in front.
    cache, early, late = paged_cache()
    allocator = cache.allocator
    cache.insert(ids(*range(1, 9)), late)  # X on pages 3-6
    cache.insert(ids(*range(1, 13)), torch.cat((late, early)), prev_prefix_len=8)  # leaf Y on pages 1-2
    assert cache.evict(EvictParams(0, swa_num_tokens=1)) == EvictResult(0, 8), "X tombstoned"
    assert cache.evict(EvictParams(4)) == EvictResult(12, 4)
    assert allocator.full_attn_allocator.free_pages.tolist()[:6] == [3, 4, 5, 6, 1, 2]
    cache.check_integrity()


def test_an_insert_frees_the_callers_duplicates_node_by_node() -> None:
    # SGLang: _insert_helper frees value[:prefix_len] at each node it walks, one free() each.
    cache, early, late = paged_cache()
    allocator = cache.allocator
    tree_slots = allocator.alloc(8)
    assert tree_slots is not None
    cache.insert(ids(1, 2, 3, 4), tree_slots[:4])
    cache.insert(ids(1, 2, 3, 4, 5, 6, 7, 8), tree_slots, prev_prefix_len=4)  # X = [1..4], Y = [5..8]
    cache.insert(ids(1, 2, 3, 4, 5, 6, 7, 8), torch.cat((early, late[:4])))  # duplicates: pages 1-2, then 3-4
    assert allocator.full_attn_allocator.free_pages.tolist()[:4] == [3, 4, 1, 2]
    assert allocator.swa_attn_allocator.free_pages.tolist()[:4] == [3, 4, 1, 2]
    cache.check_integrity()


def test_phase_two_counts_the_tombstone_parents_it_deletes() -> None:
    # kvscope's full count is the true one; SGLang 0.5.18 reports 4 here (it drops the return of
    # _iteratively_delete_tombstone_leaf in phase 2). docs/memory-semantics.md §14.1.
    cache, allocator = make_cache(window_len=4)
    insert_fresh(cache, ids(*range(1, 9)))
    insert_fresh(cache, ids(*range(1, 13)))
    assert cache.evict(EvictParams(0, swa_num_tokens=1)) == EvictResult(0, 8)
    full_before = allocator.full_available_size()
    assert cache.evict(EvictParams(0, swa_num_tokens=1)) == EvictResult(12, 4)
    assert allocator.full_available_size() - full_before == 12
    cache.check_integrity()


def test_evict_tokens_frees_what_evict_frees_and_returns_the_full_count() -> None:
    twins = [make_cache(window_len=4)[0] for _ in range(2)]
    for cache in twins:
        insert_fresh(cache, ids(*range(1, 9)))
        insert_fresh(cache, ids(*range(1, 13)))
        insert_fresh(cache, ids(20, 21, 22))
    assert twins[0].evict(EvictParams(3, swa_num_tokens=9)) == EvictResult(12, 12)
    assert twins[1].evict_tokens(3, 9) == 12
    assert keys(twins[0]) == keys(twins[1]) == [[20, 21, 22]]
    for cache in twins:
        cache.check_integrity()
