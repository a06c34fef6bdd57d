"""Brute-force what-if replays: a request stream through the radix cache alone (no model), at
one capacity per replay, several capacities in parallel processes.

NOTE: one request of a replay (prompt P, all_ids = P + O, seq_len = |all_ids|), the protocol of
benchmarks/bench_radix.py, so hit rates compare with its figures:
    match   m = match_prefix(P); inc_lock_ref(m.last_node); hit = len(m) (whole pages)
    evict   need = ceil_ps(seq_len) - hit slots; if free < need: evict(min(need - free, evictable))
    alloc   page size 1: alloc(need); else alloc_extend([hit], [seq_len], [last matched slot or -1])
            still short (the request alone exceeds the pool): unlock, count it skipped (hit -1)
    insert  p = insert(all_ids, matched + new slots); free the duplicates [hit, p) and the
            sub-page tail [floor_ps(seq_len), seq_len); dec_lock_ref(m.last_node)
bench_radix runs it with eviction_granularity="leaf" (the default), the slots convention and LRU.
Conventions for `capacity`:
    "slots"  the pool has `capacity` slots, shared by the tree and the request in flight
             (bench_radix's protocol; SGLang's max_total_num_tokens at concurrency 1)
    "tree"   the tree may hold `capacity` tokens between requests: the pool has
             capacity + ceil_ps(longest request) slots, so the request in flight never
             evicts, and after it is inserted and unlocked the tree is evicted back to
             `capacity`. The one-pass curve (curve.py) is exact under this convention with
             eviction_granularity="page".
Peak usage = the most slots in use at once (tree + the request in flight, whole pages).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

from kvscope.cache import EvictParams, RadixCache, get_policy
from kvscope.mem import make_token_allocator
from kvscope.planning.requests import ReplayRequest

Convention = Literal["slots", "tree"]
Granularity = Literal["page", "leaf"]
CONVENTIONS: tuple[Convention, ...] = ("slots", "tree")
GRANULARITIES: tuple[Granularity, ...] = ("page", "leaf")
PROGRESS_TICK_S = 0.5


@dataclass(frozen=True)
class ReplayConfig:
    capacity: int  # tokens; a multiple of page_size
    page_size: int = 1
    eviction_granularity: Granularity = "page"
    convention: Convention = "slots"
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page size must be a power of two >= 1, got {self.page_size}")
        if self.capacity < 0 or self.capacity % self.page_size:
            raise ValueError(f"capacity {self.capacity} must be >= 0 and a multiple of the page size {self.page_size}")
        if self.convention == "slots" and self.capacity < self.page_size:
            raise ValueError(f"a pool of {self.capacity} slots holds no page; the slots convention needs >= 1 page")
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {self.convention!r}")
        if self.eviction_granularity not in GRANULARITIES:
            raise ValueError(f"eviction granularity must be one of {GRANULARITIES}, got {self.eviction_granularity!r}")
        get_policy(self.eviction_policy)  # CacheMisuseError (a ValueError) names the valid ones


class ReplayResult(NamedTuple):
    config: ReplayConfig
    request_hit_tokens: np.ndarray  # int64 per request; -1 for a skipped request
    num_prompt_tokens: int
    num_evicted_tokens: int
    peak_usage_tokens: int
    wall_s: float

    @property
    def num_requests(self) -> int:
        return len(self.request_hit_tokens)

    @property
    def num_skipped(self) -> int:
        return int((self.request_hit_tokens < 0).sum())

    @property
    def num_hit_tokens(self) -> int:
        return int(self.request_hit_tokens[self.request_hit_tokens > 0].sum())

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / max(self.num_prompt_tokens, 1)


def ceil_pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size) * page_size


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


# -- several capacities in parallel ---------------------------------------------------------------

_worker_requests: list[ReplayRequest] = []


def _init_worker(sequences: list[tuple[int, np.ndarray]]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: Ctrl-C is the parent's to handle
    torch.set_num_threads(1)
    _worker_requests[:] = [ReplayRequest(str(i), ids[:n], ids) for i, (n, ids) in enumerate(sequences)]


def _replay_in_worker(config: ReplayConfig) -> ReplayResult:
    return replay(_worker_requests, config)


def _terminate_workers(pool: cf.ProcessPoolExecutor) -> None:
    """NOTE: ProcessPoolExecutor has no public way to stop running workers before Python 3.14
    (terminate_workers); its private process table is the only handle."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()


def replay_many(
    requests: Sequence[ReplayRequest],
    configs: Sequence[ReplayConfig],
    max_workers: int | None = None,
    on_done: Callable[[int, int], None] | None = None,
) -> list[ReplayResult]:
    """One replay per config, in worker processes (at most os.cpu_count(), one per config);
    results in the order of `configs`. `on_done(num_done, num_total)` after each one finishes
    and every PROGRESS_TICK_S while they run. With one worker (or one config) the replays run
    in this process. Workers are spawned (not forked: the parent holds torch, and may hold
    threads), so a script that calls this needs the `if __name__ == "__main__":` guard."""
    num_workers = min(len(configs), max_workers or os.cpu_count() or 1, os.cpu_count() or 1)
    results: list[ReplayResult | None] = [None] * len(configs)
    if num_workers <= 1:
        for k, config in enumerate(configs):
            results[k] = replay(requests, config)
            if on_done:
                on_done(k + 1, len(configs))
        return [r for r in results if r is not None]
    sequences = [(r.prompt_len, r.all_ids) for r in requests]
    # NOTE: spawn, not fork: the parent has torch loaded, and a forked child of a process
    # with OpenMP threads can hang; the request stream goes to each worker once
    context = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(num_workers, mp_context=context, initializer=_init_worker,
                                initargs=(sequences,)) as pool:
        futures = {pool.submit(_replay_in_worker, config): k for k, config in enumerate(configs)}
        pending = set(futures)
        try:
            while pending:
                done, pending = cf.wait(pending, timeout=PROGRESS_TICK_S, return_when=cf.FIRST_COMPLETED)
                for future in done:
                    results[futures[future]] = future.result()
                if on_done:
                    on_done(len(configs) - len(pending), len(configs))
        except BaseException:  # NOTE: Ctrl-C or a failed replay: start no more, end the running ones
            pool.shutdown(wait=False, cancel_futures=True)
            _terminate_workers(pool)
            raise
    return [r for r in results if r is not None]
