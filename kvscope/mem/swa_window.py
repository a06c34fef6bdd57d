"""Freeing SWA slots of tokens that have left the sliding window (§2.7).

NOTE: each request keeps a frontier `swa_evicted_len`: positions [0, frontier) have had
their SWA half freed (or are owned by the tree). Moving the frontier frees the SWA half of
positions [old, new) through `free_swa`; their full KV stays with the request.
    radix caches: threshold = pre_len - max(window, page_size), never below the tree's range
    chunk caches: threshold = pre_len - window
    new frontier = page_floor(max(old, threshold))
The engine decides when to call (decode interval, once per chunk); this is the slot work.
"""

from __future__ import annotations

from kvscope.mem.req_to_token import ReqToTokenPool
from kvscope.mem.swa_allocator import SWATokenToKVPoolAllocator


def swa_window_frontier(
    old_frontier_len: int, pre_len: int, window_len: int, page_size: int, *, for_radix: bool
) -> int:
    """Where the frontier moves to; never backwards."""
    threshold = pre_len - max(window_len, page_size) if for_radix else pre_len - window_len
    target = max(old_frontier_len, threshold) // page_size * page_size
    return max(old_frontier_len, target)


def free_swa_out_of_window(
    allocator: SWATokenToKVPoolAllocator,
    req_to_token_pool: ReqToTokenPool,
    row: int,
    old_frontier_len: int,
    pre_len: int,
    window_len: int,
    *,
    for_radix: bool,
) -> int:
    """Free the SWA half of positions that left the window; return the new frontier."""
    new_frontier_len = swa_window_frontier(
        old_frontier_len, pre_len, window_len, allocator.page_size, for_radix=for_radix
    )
    if new_frontier_len > old_frontier_len:
        allocator.free_swa(req_to_token_pool.read(row, old_frontier_len, new_frontier_len))
    return new_frontier_len
