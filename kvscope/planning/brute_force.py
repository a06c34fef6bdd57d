"""Brute-force what-if replays: a request stream through the radix cache alone (no model), at
one capacity per replay (replays.py holds their config and runs several in worker processes).

NOTE: one request of a replay (prompt P, all_ids = P + O, seq_len = |all_ids|), the protocol of
benchmarks/bench_radix.py, so hit rates compare with its figures:
    match   m = match_prefix(P); inc_lock_ref(m.last_node); hit = len(m) (whole pages)
    evict   need = ceil_ps(seq_len) - hit slots; if free < need: evict(min(need - free, evictable))
    alloc   page size 1: alloc(need); else alloc_extend([hit], [seq_len], [last matched slot or -1])
            still short (the request alone exceeds the pool): unlock, count it skipped (hit -1)
    insert  p = insert(all_ids, matched + new slots); free the duplicates [hit, p) and the
            sub-page tail [floor_ps(seq_len), seq_len); dec_lock_ref(m.last_node)
bench_radix runs it with eviction_granularity="leaf" (the default), the slots convention and LRU;
the capacity conventions are in replays.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from kvscope.cache import EvictParams, RadixCache
from kvscope.mem import make_token_allocator
from kvscope.planning.replays import ReplayConfig, ReplayResult, ceil_pages
from kvscope.planning.requests import ReplayRequest


def replay(requests: Sequence[ReplayRequest], config: ReplayConfig) -> ReplayResult:
    """Serve `requests` one at a time through a fresh radix cache (see the module doc)."""
    ps = config.page_size
    headroom = max((ceil_pages(r.seq_len, ps) for r in requests), default=ps) if config.convention == "tree" else 0
    server = _Server(config, config.capacity + headroom)
    hits = np.full(len(requests), -1, dtype=np.int64)
    trim_to = config.capacity if config.convention == "tree" else None
    start = time.perf_counter()
    for i, request in enumerate(requests):
        hits[i] = server.serve(request)
        if trim_to is not None:
            server.trim(trim_to)
    wall_s = time.perf_counter() - start
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    return ReplayResult(config, hits, num_prompt_tokens, server.num_evicted, server.peak_usage, wall_s)


class _Server:
    """A radix cache and its allocator, serving one request at a time (the protocol above)."""

    def __init__(self, config: ReplayConfig, num_slots: int) -> None:
        self.page_size = config.page_size
        self.allocator = make_token_allocator(num_slots, config.page_size, "cpu")
        self.cache = RadixCache(self.allocator, page_size=config.page_size, eviction_policy=config.eviction_policy,
                                eviction_granularity=config.eviction_granularity)
        self.num_evicted = 0
        self.peak_usage = 0

    def serve(self, request: ReplayRequest) -> int:
        """Hit tokens, or -1 when the request does not fit in the pool at all."""
        cache, allocator, ps = self.cache, self.allocator, self.page_size
        match = cache.match_prefix(request.prompt_ids)
        prefix_slots, node, prefix_len = match.device_indices, match.last_node, match.prefix_len
        seq_len = request.seq_len
        cache.inc_lock_ref(node)
        shortfall = ceil_pages(seq_len, ps) - prefix_len - allocator.available_size()
        if shortfall > 0 and cache.evictable_size() > 0:
            self.num_evicted += cache.evict(EvictParams(min(shortfall, cache.evictable_size()))).num_tokens_evicted
        if ps == 1:
            new_slots = allocator.alloc(seq_len - prefix_len)
        else:
            last_loc = int(prefix_slots[-1]) if prefix_len else -1
            new_slots = allocator.alloc_extend([prefix_len], [seq_len], [last_loc], seq_len - prefix_len)
        if new_slots is None:
            cache.dec_lock_ref(node)
            return -1
        self.peak_usage = max(self.peak_usage, allocator.total_size - allocator.available_size())
        slots = torch.cat((prefix_slots, new_slots))
        cached_len = cache.insert(request.all_ids, slots)
        key_len = seq_len // ps * ps
        if cached_len > prefix_len:
            allocator.free(slots[prefix_len:cached_len])
        if key_len < seq_len:
            allocator.free(slots[key_len:])
        cache.dec_lock_ref(node)
        return prefix_len

    def trim(self, capacity: int) -> None:
        """Evict the tree back to `capacity` tokens (tree convention, between requests)."""
        if self.cache.total_size() > capacity:
            self.num_evicted += self.cache.evict(EvictParams(self.cache.total_size() - capacity)).num_tokens_evicted
