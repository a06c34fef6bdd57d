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
the capacity conventions are in replays.py. Match and insert name the request's user; a scoped
replay's cache reads the clock `now`, set to the request's trace time before it is served.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvscope.cache import BasePrefixCache, RadixCache
from kvscope.cache.tree import TOKEN_BYTES, common_page_len
from kvscope.mem import BaseTokenAllocator, make_token_allocator
from kvscope.planning.replays import ReplayConfig, ReplayResult, ceil_pages
from kvscope.planning.requests import ReplayRequest, trace_times_s


def replay(requests: Sequence[ReplayRequest], config: ReplayConfig, *, check_integrity: bool = False) -> ReplayResult:
    """Serve `requests` one at a time through a fresh radix cache (see the module doc);
    `check_integrity`: run the cache's check_integrity() after every request (tests)."""
    ps = config.page_size
    headroom = max((ceil_pages(r.seq_len, ps) for r in requests), default=ps) if config.convention == "tree" else 0
    server = _Server(config, config.capacity + headroom)
    hits = np.full(len(requests), -1, dtype=np.int64)
    cross = np.full(len(requests), -1, dtype=np.int64)
    times_s = trace_times_s(requests)
    trim_to = config.capacity if config.convention == "tree" else None
    start = time.perf_counter()
    for i, request in enumerate(requests):
        server.now = float(times_s[i])
        hits[i], cross[i] = server.serve(request)
        if trim_to is not None:
            server.trim(trim_to)
        if check_integrity:
            server.cache.check_integrity()
    wall_s = time.perf_counter() - start
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    return ReplayResult(
        config, hits, num_prompt_tokens, server.num_evicted, server.peak_usage, wall_s, cross, server.cache_stats()
    )


def build_replay_cache(config: ReplayConfig, allocator: BaseTokenAllocator, clock: Any) -> BasePrefixCache:
    """The radix cache (global sharing), or the scoped one on `clock` when config.scoped is set."""
    if config.scoped is None:
        return RadixCache(
            allocator,
            page_size=config.page_size,
            eviction_policy=config.eviction_policy,
            eviction_granularity=config.eviction_granularity,
        )
    from kvscope.cache.scoped import ScopedRadixCache  # NOTE: loaded by the replays that use it

    scoped = config.scoped
    return ScopedRadixCache(
        allocator,
        config.page_size,
        eviction_policy=config.eviction_policy,
        eviction_granularity=config.eviction_granularity,
        promote_k=scoped.promote_k,
        epoch_s=scoped.epoch_s,
        pinned=scoped.pinned,
        dedup=scoped.dedup,
        merge_chains=scoped.merge_chains,
        clock=clock,
    )


def foreign_tokens(node: Any, user: str | None) -> int:
    """Tokens on the path root..node in shared nodes another principal created: sharing across
    principals. NOTE: a private node `user` sees is its own computation even when another
    principal created it (dedup makes `user` a holder), so it does not count; the scoped cache's
    own cross_hit_tokens counts by owner alone. None and "" are both the anonymous principal."""
    num_tokens, principal = 0, user or ""
    while node is not None and node.parent is not None:
        if (getattr(node, "owner", None) or "") != principal and getattr(node, "visibility", "public") != "private":
            num_tokens += len(node.value)
        node = node.parent
    return num_tokens


def jsonable_stats(stats: Any) -> dict[str, Any] | None:
    """A dataclass of counters as a JSON-ready dict: a dict with tuple keys becomes a list of
    [*key, value] rows."""
    if not dataclasses.is_dataclass(stats) or isinstance(stats, type):
        return None
    out: dict[str, Any] = {}
    for name, value in dataclasses.asdict(stats).items():
        if isinstance(value, dict) and any(isinstance(k, tuple) for k in value):
            value = [[*k, v] if isinstance(k, tuple) else [k, v] for k, v in value.items()]
        out[name] = value
    return out


def fleet_servers(config: ReplayConfig, num_slots: int, dp_size: int) -> list[_Server]:
    """One server per replica of a fleet replay (fleet_replay.py)."""
    return [_Server(config, num_slots) for _ in range(dp_size)]


class _Server:
    """A radix cache and its allocator, serving one request at a time (the protocol above)."""

    def __init__(self, config: ReplayConfig, num_slots: int) -> None:
        self.page_size = config.page_size
        self.now = 0.0  # trace seconds: the scoped cache's clock
        self.allocator = make_token_allocator(num_slots, config.page_size, "cpu")
        self.cache = build_replay_cache(config, self.allocator, lambda: self.now)
        self.num_evicted = 0
        self.peak_usage = 0

    def cache_stats(self) -> dict[str, Any] | None:
        """The scoped cache's stats as a dict; None for the radix cache."""
        stats = getattr(self.cache, "stats", None)
        return None if stats is None else jsonable_stats(stats())

    def peek(self, request: ReplayRequest) -> int:
        """The prompt's page-aligned match length in this cache, without touching it (no access
        times, no split): what a replica reports holding for prefix_affinity."""
        key = request.prompt_ids[: request.prompt_len // self.page_size * self.page_size].tobytes()
        node, pos = self.cache.root, 0
        page_bytes = self.page_size * TOKEN_BYTES
        while pos < len(key):
            child = node.children.get(key[pos : pos + page_bytes])
            if child is None:
                break
            if not key.startswith(child.key, pos):
                return pos // TOKEN_BYTES + common_page_len(child.key, key, pos, self.page_size)
            pos += len(child.key)
            node = child
        return pos // TOKEN_BYTES

    def serve(self, request: ReplayRequest) -> tuple[int, int]:
        """(hit tokens, of which cross-principal), or (-1, -1) when the request does not fit in
        the pool at all."""
        cache, allocator, ps = self.cache, self.allocator, self.page_size
        user = request.user
        match = cache.match_prefix(request.prompt_ids, user=user, rid=request.rid)
        prefix_slots, node, prefix_len = match.device_indices, match.last_node, match.prefix_len
        cross_len = foreign_tokens(node, user)
        seq_len = request.seq_len
        cache.inc_lock_ref(node)
        shortfall = ceil_pages(seq_len, ps) - prefix_len - allocator.available_size()
        if shortfall > 0 and cache.evictable_size() > 0:
            self.num_evicted += cache.evict_tokens(min(shortfall, cache.evictable_size()))
        if ps == 1:
            new_slots = allocator.alloc(seq_len - prefix_len)
        else:
            last_loc = int(prefix_slots[-1]) if prefix_len else -1
            new_slots = allocator.alloc_extend([prefix_len], [seq_len], [last_loc], seq_len - prefix_len)
        if new_slots is None:
            cache.dec_lock_ref(node)
            return -1, -1
        self.peak_usage = max(self.peak_usage, allocator.total_size - allocator.available_size())
        slots = torch.cat((prefix_slots, new_slots))
        cached_len = cache.insert(request.all_ids, slots, user=user, rid=request.rid)
        key_len = seq_len // ps * ps
        if cached_len > prefix_len:
            allocator.free(slots[prefix_len:cached_len])
        if key_len < seq_len:
            allocator.free(slots[key_len:])
        cache.dec_lock_ref(node)
        return prefix_len, cross_len

    def trim(self, capacity: int) -> None:
        """Evict the tree back to `capacity` tokens (tree convention, between requests)."""
        cache = self.cache
        total = cache.evictable_size() + cache.protected_size()
        if total > capacity and cache.evictable_size() > 0:
            excess = min(total - capacity, cache.evictable_size())
            self.num_evicted += cache.evict_tokens(excess)
