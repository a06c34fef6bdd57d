"""The engine's memory system: request-to-token pool, allocator, KV buffers and prefix cache,
built from the config and the model's KV shape; usage terms and the idle leak check (§8).

NOTE: the leak invariant, exact for each pool at an idle point:
    available + evictable + protected + held + uncached == total
`held` is session-held KV (none in kvscope yet); `uncached` is the KV running requests
own beyond the tree (page_ceil(kv_len) - cache_protected_len; SWA: minus the window
frontier too), zero when truly idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvscope.cache import BasePrefixCache, ChunkCache, RadixCache, SWAChunkCache, SWARadixCache
from kvscope.engine.config import EngineConfig
from kvscope.engine.model import KVPoolShape
from kvscope.engine.request import Req
from kvscope.mem import (
    MHATokenToKVPool,
    ReqToTokenPool,
    SWAKVPool,
    SWATokenToKVPoolAllocator,
    make_token_allocator,
    resolve_device,
)
from kvscope.telemetry import LeakCheck, PoolTerms, Recorder


@dataclass
class MemorySystem:
    config: EngineConfig
    req_to_token_pool: ReqToTokenPool
    allocator: Any  # BaseTokenAllocator or SWATokenToKVPoolAllocator
    kv_pool: MHATokenToKVPool | SWAKVPool
    cache: BasePrefixCache
    window_len: int | None

    @property
    def page_size(self) -> int:
        return self.config.pool.page_size

    @property
    def is_swa(self) -> bool:
        return isinstance(self.allocator, SWATokenToKVPoolAllocator)

    # -- sizes -------------------------------------------------------------------------------

    def full_available(self) -> int:
        return self.allocator.full_available_size() if self.is_swa else self.allocator.available_size()

    def swa_available(self) -> int:
        return self.allocator.swa_available_size() if self.is_swa else 0

    def swa_evictable(self) -> int:
        return self.cache.swa_evictable_size() if isinstance(self.cache, SWARadixCache) else 0

    def swa_protected(self) -> int:
        return self.cache.swa_protected_size() if isinstance(self.cache, SWARadixCache) else 0

    def full_terms(self) -> PoolTerms:
        total = self.config.pool.full_size_tokens
        return PoolTerms(total, self.full_available(), self.cache.evictable_size(), self.cache.protected_size())

    def swa_terms(self) -> PoolTerms | None:
        if not self.is_swa:
            return None
        return PoolTerms(self.config.pool.swa_size_tokens, self.swa_available(), self.swa_evictable(),
                         self.swa_protected())

    def evict(self, full_tokens: int, swa_tokens: int = 0) -> int:
        """Evict the shortfalls, clamped to what the tree can give; returns full tokens freed."""
        full = min(max(full_tokens, 0), self.cache.evictable_size())
        if isinstance(self.cache, SWARadixCache):
            swa = min(max(swa_tokens, 0), self.swa_evictable())
            return self.cache.evict(full, swa) if full or swa else 0
        return self.cache.evict(full) if full else 0

    # -- the leak check ----------------------------------------------------------------------

    def leak_checks(self, step: int, holders: Sequence[Req]) -> list[LeakCheck]:
        ps = self.page_size
        full, swa = self.full_terms(), self.swa_terms()
        uncached = sum(-(-r.kv_committed_len // ps) * ps - r.cache_protected_len for r in holders)
        checks = [LeakCheck(step, "full", full.total, full.available, full.evictable, full.protected, 0, uncached)]
        if swa is not None:
            swa_uncached = sum(-(-r.kv_committed_len // ps) * ps - max(r.cache_protected_len, r.swa_evicted_len)
                               for r in holders)
            checks.append(LeakCheck(step, "swa", swa.total, swa.available, swa.evictable, swa.protected, 0,
                                    swa_uncached))
        rows = self.req_to_token_pool
        held_rows = sum(1 for r in holders if r.req_pool_idx is not None)
        checks.append(LeakCheck(step, "req", rows.num_rows, rows.available_size(), 0, 0, 0, held_rows))
        return checks


def build_memory(config: EngineConfig, shape: KVPoolShape, window_len: int | None, recorder: Recorder) -> MemorySystem:
    pool_cfg = config.pool
    device = resolve_device(config.device)
    ps = pool_cfg.page_size
    rows = ReqToTokenPool(pool_cfg.max_running_requests, pool_cfg.max_context_len, device, strict=config.strict)
    if shape.is_hybrid:
        allocator: Any = SWATokenToKVPoolAllocator(pool_cfg.full_size_tokens, pool_cfg.swa_size_tokens, ps, device,
                                                   strict=config.strict)
        full = MHATokenToKVPool(pool_cfg.full_size_tokens, ps, shape.dtype, shape.num_kv_heads, shape.head_dim,
                                shape.num_full_layers, device, name="full")
        swa = MHATokenToKVPool(pool_cfg.swa_size_tokens, ps, shape.dtype, shape.num_kv_heads, shape.head_dim,
                               shape.num_swa_layers, device, name="swa")
        kv_pool: MHATokenToKVPool | SWAKVPool = SWAKVPool(full, swa, list(shape.swa_layer_ids),
                                                          allocator.full_to_swa_index_mapping)
    else:
        allocator = make_token_allocator(pool_cfg.full_size_tokens, ps, device, strict=config.strict)
        kv_pool = MHATokenToKVPool(pool_cfg.full_size_tokens, ps, shape.dtype, shape.num_kv_heads, shape.head_dim,
                                   shape.num_full_layers, device)
    allocator.recorder = recorder
    cache = build_cache(config, allocator, rows, window_len, shape.is_hybrid, recorder)
    return MemorySystem(config, rows, allocator, kv_pool, cache, window_len)


def build_cache(config: EngineConfig, allocator: Any, rows: ReqToTokenPool, window_len: int | None, hybrid: bool,
                recorder: Recorder) -> BasePrefixCache:
    """radix / swa-radix keep a tree; chunk and none keep nothing (SGLang frees the same way)."""
    kind, ps = config.cache.kind, config.pool.page_size
    if kind == "radix":
        return RadixCache(allocator, ps, req_to_token_pool=rows, eviction_policy=config.cache.eviction_policy,
                          eviction_granularity=config.cache.eviction_granularity, recorder=recorder,
                          strict=config.strict)
    if kind == "swa-radix":
        assert window_len is not None
        return SWARadixCache(allocator, ps, window_len=window_len, req_to_token_pool=rows, recorder=recorder,
                             strict=config.strict)
    if hybrid:
        assert window_len is not None
        return SWAChunkCache(allocator, ps, req_to_token_pool=rows, window_len=window_len, recorder=recorder)
    return ChunkCache(allocator, ps, req_to_token_pool=rows, recorder=recorder)
