"""RadixCache frees a request's duplicates as SGLang does (free_segment), so its pages take the
same place in a free group's release order (docs/memory-semantics.md §2.5, §4.6)."""

from __future__ import annotations

import numpy as np

from kvscope.cache import EvictParams, RadixCache
from kvscope.mem import ReqToTokenPool, make_token_allocator
from tests.cache.helpers import Req


def test_a_radix_requests_duplicates_are_freed_as_a_segment() -> None:
    # SGLang: RadixCache.cache_unfinished_req frees the duplicates with free_segment, so in a
    # group their pages go in front of the pages other requests free with free().
    allocator = make_token_allocator(32, 2, strict=True)
    rows = ReqToTokenPool(4, 16, "cpu", strict=True)
    cache = RadixCache(allocator, 2, req_to_token_pool=rows, strict=True)
    other, tree, mine = allocator.alloc(4), allocator.alloc(4), allocator.alloc(4)  # pages 1-2, 3-4, 5-6
    assert other is not None and tree is not None and mine is not None
    cache.insert(np.array([1, 2, 3, 4], dtype=np.int32), tree)
    req = Req("r", np.array([1, 2, 3, 4], dtype=np.int32), kv_committed_len=4, last_node=cache.root)
    assert rows.alloc([req]) is not None and req.req_pool_idx is not None
    rows.write(req.req_pool_idx, 0, mine)
    allocator.free_group_begin()
    allocator.free(other)
    cache.cache_unfinished_req(req)
    allocator.free_group_end()
    assert allocator.free_pages.tolist()[:4] == [5, 6, 1, 2]
    cache.check_integrity()


def test_evict_tokens_frees_what_evict_frees() -> None:
    twins = []
    for _ in range(2):
        allocator = make_token_allocator(64, 1, strict=True)
        cache = RadixCache(allocator, 1, strict=True)
        for tokens in ([1, 2, 3, 4], [1, 2, 9], [7, 8]):
            slots = allocator.alloc(len(tokens))
            assert slots is not None
            prefix_len = cache.insert(np.array(tokens, dtype=np.int32), slots)
            allocator.free(slots[:prefix_len])  # the duplicates
        twins.append((cache, allocator))
    assert twins[0][0].evict(EvictParams(3)).num_tokens_evicted == twins[1][0].evict_tokens(3) == 3
    assert twins[0][1].free_pages.tolist() == twins[1][1].free_pages.tolist()
    for cache, _ in twins:
        cache.check_integrity()
