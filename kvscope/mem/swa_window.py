"""Freeing SWA slots of tokens that have left the sliding window (docs/memory-semantics.md §2.7).

NOTE: each request keeps a frontier `swa_evicted_len`: positions [0, frontier) have had
their SWA half freed (or are owned by the tree). Moving the frontier frees the SWA half of
positions [old, new) through `free_swa`; their full KV stays with the request.
    threshold    = pre_len - keep_len    (the newest keep_len tokens keep their SWA KV)
    new frontier = page_floor(max(old, threshold)), never below old
`keep_len` is the cache family's rule: radix caches keep max(window, page_size) (and never
move below the tree's range), chunk caches keep the window. The engine decides when to
call (decode interval, once per chunk); this is the slot work.
"""

from __future__ import annotations

from kvscope.mem.req_to_token import ReqToTokenPool
from kvscope.mem.swa_allocator import SWATokenToKVPoolAllocator


def swa_window_frontier(old_frontier_len: int, pre_len: int, keep_len: int, page_size: int) -> int:
    """Where the frontier moves to; never backwards."""
    target = max(old_frontier_len, pre_len - keep_len) // page_size * page_size
    return max(old_frontier_len, target)


def free_swa_range(
    allocator: SWATokenToKVPoolAllocator, req_to_token_pool: ReqToTokenPool, row: int, start_len: int, end_len: int
) -> None:
    """Free the SWA half of positions [start_len, end_len) of `row`; nothing when empty."""
    if end_len > start_len:
        allocator.free_swa(req_to_token_pool.read(row, start_len, end_len))


def free_swa_out_of_window(
    allocator: SWATokenToKVPoolAllocator,
    req_to_token_pool: ReqToTokenPool,
    row: int,
    old_frontier_len: int,
    pre_len: int,
    keep_len: int,
) -> int:
    """Free the SWA half of positions that left the window; return the new frontier."""
    new_frontier_len = swa_window_frontier(old_frontier_len, pre_len, keep_len, allocator.page_size)
    free_swa_range(allocator, req_to_token_pool, row, old_frontier_len, new_frontier_len)
    return new_frontier_len
