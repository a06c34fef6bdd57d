"""ChunkCache and SWAChunkCache (docs/memory-semantics.md §6): nothing kept, everything freed; the SWA
variant frees the SWA half of tokens that left the window."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.cache import CacheMisuseError, ChunkCache, EvictParams, EvictResult, SWAChunkCache
from kvscope.mem import ReqToTokenPool, SWATokenToKVPoolAllocator, make_token_allocator
from tests.cache.helpers import Req


def test_chunk_cache_keeps_nothing_and_frees_everything() -> None:
    allocator = make_token_allocator(32, 1, strict=True)
    rows = ReqToTokenPool(2, 32)
    cache = ChunkCache(allocator, 1, req_to_token_pool=rows)
    req = Req("r1", np.arange(6, dtype=np.int32), kv_committed_len=5)
    rows.alloc([req])
    rows.write(req.req_pool_idx, 0, allocator.alloc(6))  # type: ignore[arg-type]
    assert cache.match_prefix(req.fill_ids).prefix_len == 0
    cache.cache_unfinished_req(req)
    assert len(req.prefix_indices) == 6 and allocator.available_size() == 26
    cache.cache_finished_req(req)
    assert allocator.available_size() == 31, "the 6th slot was never committed, so it stays"
    with pytest.raises(CacheMisuseError, match="evictable size 0"):
        cache.evict(EvictParams(1))
    with pytest.raises(CacheMisuseError, match="evictable size 0"):
        cache.evict(EvictParams(0, swa_num_tokens=1))
    assert cache.evict(EvictParams()) == EvictResult(0, 0)


def test_swa_chunk_cache_frees_window_slots() -> None:
    allocator = SWATokenToKVPoolAllocator(32, 16, 1, strict=True)
    rows = ReqToTokenPool(2, 32)
    cache = SWAChunkCache(allocator, 1, req_to_token_pool=rows, window_len=4)
    req = Req("r1", np.arange(10, dtype=np.int32), kv_committed_len=10)
    rows.alloc([req])
    rows.write(req.req_pool_idx, 0, allocator.alloc(10))  # type: ignore[arg-type]
    cache.free_out_of_window(req, pre_len=10)
    assert req.swa_evicted_len == 6 and allocator.swa_available_size() == 12
    cache.cache_finished_req(req)
    assert allocator.swa_available_size() == 16 and allocator.full_available_size() == 32
    allocator.check_integrity([])


def test_swa_chunk_window_rule_keeps_the_window_from_the_frontier() -> None:
    """Chunk rule: threshold pre_len - window, page-floored, never behind the frontier."""
    allocator = SWATokenToKVPoolAllocator(64, 32, 4, strict=True)
    cache = SWAChunkCache(allocator, 4, req_to_token_pool=ReqToTokenPool(2, 64), window_len=3)
    req = Req("r1", np.arange(20, dtype=np.int32), cache_protected_len=8, swa_evicted_len=4)
    assert cache.window_range(req, 20) == (4, 16)
    assert cache.window_range(req, 9) == (4, 4)
