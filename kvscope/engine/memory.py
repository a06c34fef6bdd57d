"""The engine's memory system: request-to-token pool, allocator, KV buffers and prefix cache,
built from the config and the model's KV shape; usage terms and the idle leak check (docs/memory-semantics.md §8).

Three variants behind one interface, picked once by `build_memory` from the model's shape
and the cache kind: `MemorySystem` (full attention: one token pool), `SWAMemorySystem` (hybrid
sliding-window models: a full pool and an SWA pool in lockstep, with window freeing) and
`HiMemorySystem` (full attention with the hiradix cache: the device pool over a host pool).
The scheduler asks for sizes, eviction and window freeing without knowing which one it holds.

NOTE: the leak invariant, exact for each pool at an idle point:
    available + evictable + protected + held + uncached == total
`held` is session-held KV (none in kvscope yet); `uncached` is the KV running requests
own beyond the tree (page_ceil(kv_len) - cache_protected_len; SWA: minus the window
frontier too), zero when truly idle. The host pool (hiradix) balances on its own:
    host available + host slots the tree holds (as evictable) == host total
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvscope.cache import BasePrefixCache, SWAPrefixCache
from kvscope.cache.hiradix import HiRadixCache
from kvscope.engine.cache_kinds import CacheParts, cache_kind, check_fits_model
from kvscope.engine.config import EngineConfig
from kvscope.engine.model import KVPoolShape
from kvscope.engine.request import Req
from kvscope.mem import (
    CacheController,
    HostTokenAllocator,
    KVPool,
    MHATokenToKVPool,
    ReqToTokenPool,
    SWAKVPool,
    SWATokenToKVPoolAllocator,
    TokenAllocator,
    charged_to,
    make_token_allocator,
    resolve_device,
)
from kvscope.telemetry import EvictReason, LeakCheck, PoolTerms, Recorder


class HostTierTotals(NamedTuple):
    """What the host tier did over a run (hiradix), in tokens."""

    host_tokens: int  # the host pool's size
    written: int  # device -> host copies
    loaded: int  # host -> device copies (load-back)
    dropped: int  # write_back: device tokens the host could not take


# (memory, request, start_len, end_len) -> True when it took the window move over (a fault)
WindowHook = Callable[["SWAMemorySystem", Req, int, int], bool]


class MemorySystem:
    """Full attention: one token pool; nothing leaves a window."""

    def __init__(
        self,
        config: EngineConfig,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenAllocator,
        kv_pool: KVPool,
        cache: BasePrefixCache,
    ) -> None:
        self.config = config
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.cache = cache

    @property
    def page_size(self) -> int:
        return self.config.pool.page_size

    # -- sizes -------------------------------------------------------------------------------

    def available_size(self) -> int:
        """Tokens every pool can still hand out without evicting."""
        return self.allocator.available_size()

    def full_available(self) -> int:
        return self.allocator.available_size()

    def reclaimable_size(self) -> int:
        """Tokens every pool could hand out after evicting all it can: available + evictable."""
        return self.full_available() + self.cache.evictable_size()

    def full_terms(self) -> PoolTerms:
        total = self.config.pool.full_size_tokens
        return PoolTerms(total, self.full_available(), self.cache.evictable_size(), self.cache.protected_size())

    def swa_terms(self) -> PoolTerms | None:
        return None

    def host_terms(self) -> PoolTerms | None:
        """The host tier's terms (hiradix); None: no host tier."""
        return None

    def copied_tokens(self) -> tuple[int, int]:
        """Tokens copied device -> host and host -> device so far (written, loaded)."""
        return 0, 0

    def host_totals(self) -> HostTierTotals | None:
        """The host tier's totals so far; None: no host tier."""
        return None

    def evict_for(self, num_tokens: int) -> int:
        """Evict so that `num_tokens` more fit in every pool, clamped to what the tree can give;
        returns the full-pool tokens freed."""
        full = min(max(num_tokens - self.full_available(), 0), self.cache.evictable_size())
        return self.cache.evict_tokens(full) if full else 0

    def evict_all(self) -> int:
        """Evict every unlocked cached token (SGLang's flush_cache, called with nothing running):
        each leaf leaves as an eviction does, freed and recorded with reason reset; returns the
        full-pool tokens freed."""
        full = self.cache.evictable_size()
        with self.cache.evicting_as(EvictReason.RESET):
            return self.cache.evict_tokens(full) if full else 0

    # -- the sliding window --------------------------------------------------------------------

    def free_windows_before_extend(self, batch: Sequence[Req], hook: WindowHook | None) -> None:
        """Before a prefill extends `batch`: full attention keeps every token."""

    def free_windows_for_decode(self, batch: Sequence[Req], interval: int, hook: WindowHook | None) -> None:
        """Before a decode step: full attention keeps every token."""

    # -- the leak check ----------------------------------------------------------------------

    def leak_checks(self, step: int, holders: Sequence[Req]) -> list[LeakCheck]:
        rows = self.req_to_token_pool
        held_rows = sum(1 for r in holders if r.req_pool_idx is not None)
        req_check = LeakCheck(step, "req", rows.num_rows, rows.available_size(), 0, 0, 0, held_rows)
        return [*self.pool_checks(step, holders), req_check]

    def pool_checks(self, step: int, holders: Sequence[Req]) -> list[LeakCheck]:
        ps = self.page_size
        full = self.full_terms()
        uncached = sum(-(-r.kv_committed_len // ps) * ps - r.cache_protected_len for r in holders)
        return [LeakCheck(step, "full", full.total, full.available, full.evictable, full.protected, 0, uncached)]


class SWAMemorySystem(MemorySystem):
    """Hybrid sliding-window models: a full pool and an SWA pool; tokens that leave the
    window give their SWA half back (the cache family's rule says which, the engine when)."""

    allocator: SWATokenToKVPoolAllocator
    cache: SWAPrefixCache

    def __init__(
        self,
        config: EngineConfig,
        req_to_token_pool: ReqToTokenPool,
        allocator: SWATokenToKVPoolAllocator,
        kv_pool: SWAKVPool,
        cache: SWAPrefixCache,
        window_len: int,
    ) -> None:
        super().__init__(config, req_to_token_pool, allocator, kv_pool, cache)
        self.window_len = window_len

    def full_available(self) -> int:
        return self.allocator.full_available_size()

    def swa_available(self) -> int:
        return self.allocator.swa_available_size()

    def reclaimable_size(self) -> int:
        return min(super().reclaimable_size(), self.swa_available() + self.cache.swa_evictable_size())

    def swa_terms(self) -> PoolTerms:
        return PoolTerms(
            self.config.pool.swa_size_tokens,
            self.swa_available(),
            self.cache.swa_evictable_size(),
            self.cache.swa_protected_size(),
        )

    def evict_for(self, num_tokens: int) -> int:
        cache = self.cache
        full = min(max(num_tokens - self.full_available(), 0), cache.evictable_size())
        swa = min(max(num_tokens - self.swa_available(), 0), cache.swa_evictable_size())
        return cache.evict_tokens(full, swa) if full or swa else 0

    def evict_all(self) -> int:
        cache = self.cache
        full, swa = cache.evictable_size(), cache.swa_evictable_size()
        with cache.evicting_as(EvictReason.RESET):
            return cache.evict_tokens(full, swa) if full or swa else 0

    # -- the sliding window --------------------------------------------------------------------

    def free_windows_before_extend(self, batch: Sequence[Req], hook: WindowHook | None) -> None:
        """A chunk cache frees the window of a request it extends again (once per chunk).

        NOTE: for a radix tree this frees nothing: the tree owns every whole page below
        kv_committed_len and the frontier already sits at cache_protected_len, so the window
        range is empty.
        """
        for req in batch:
            if req.kv_committed_len > 0:
                self._move_window(req, req.kv_committed_len, hook)

    def free_windows_for_decode(self, batch: Sequence[Req], interval: int, hook: WindowHook | None) -> None:
        """Every `interval` tokens past the window, after the request's first decode step."""
        window_len = self.window_len
        for req in batch:
            pre_len = req.kv_committed_len
            if req.decode_steps >= 1 and pre_len - window_len >= req.swa_evicted_len + interval:
                self._move_window(req, pre_len, hook)

    def _move_window(self, req: Req, pre_len: int, hook: WindowHook | None) -> None:
        start_len, end_len = self.cache.window_range(req, pre_len)
        if hook is not None and hook(self, req, start_len, end_len):
            return
        with charged_to(self.allocator, req.rid):
            self.cache.free_window(req, start_len, end_len)

    # -- the leak check ----------------------------------------------------------------------

    def pool_checks(self, step: int, holders: Sequence[Req]) -> list[LeakCheck]:
        ps = self.page_size
        swa = self.swa_terms()
        swa_uncached = sum(
            -(-r.kv_committed_len // ps) * ps - max(r.cache_protected_len, r.swa_evicted_len) for r in holders
        )
        swa_check = LeakCheck(step, "swa", swa.total, swa.available, swa.evictable, swa.protected, 0, swa_uncached)
        return [*super().pool_checks(step, holders), swa_check]


class HiMemorySystem(MemorySystem):
    """Full attention with the two-tier hiradix cache: the device pool over a host pool that
    the cache's controller copies to and from (docs/memory-semantics.md §2.8, §7)."""

    cache: HiRadixCache

    def __init__(
        self,
        config: EngineConfig,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenAllocator,
        kv_pool: MHATokenToKVPool,
        cache: HiRadixCache,
    ) -> None:
        super().__init__(config, req_to_token_pool, allocator, kv_pool, cache)
        self.controller: CacheController = cache.controller
        self.host_allocator: HostTokenAllocator = cache.host_allocator

    def host_terms(self) -> PoolTerms:
        """evictable: every host slot the tree holds (host copies are never locked; a load pins
        its source copies only while it is in flight)."""
        host = self.host_allocator
        return PoolTerms(host.total_size, host.available_size(), self.cache.host_tokens(), 0)

    def copied_tokens(self) -> tuple[int, int]:
        return self.cache.num_write_tokens, self.cache.num_load_back_tokens

    def evict_all(self) -> int:
        """The device tier as every cache (a backed-up leaf becomes host-only: to-host), then every
        host copy no copy in flight holds (host_evict, reason reset)."""
        freed = super().evict_all()
        with self.cache.evicting_as(EvictReason.RESET):
            self.cache.evict_host(self.cache.host_tokens())
        return freed

    def host_totals(self) -> HostTierTotals:
        cache = self.cache
        return HostTierTotals(
            self.host_allocator.total_size, cache.num_write_tokens, cache.num_load_back_tokens, cache.num_dropped_tokens
        )

    def pool_checks(self, step: int, holders: Sequence[Req]) -> list[LeakCheck]:
        host = self.host_terms()
        host_check = LeakCheck(step, "host", host.total, host.available, host.evictable, host.protected, 0, 0)
        return [*super().pool_checks(step, holders), host_check]


def build_memory(config: EngineConfig, shape: KVPoolShape, window_len: int | None, recorder: Recorder) -> MemorySystem:
    """The pools for the model's shape and the cache its kind builds (cache_kinds.py)."""
    spec = cache_kind(config.cache.kind)
    check_fits_model(spec.name, shape.is_hybrid)
    pool_cfg = config.pool
    device = resolve_device(config.device)
    ps = pool_cfg.page_size
    rows = ReqToTokenPool(pool_cfg.max_running_requests, pool_cfg.max_context_len, device, strict=config.strict)
    if shape.is_hybrid:
        assert window_len is not None and spec.build_hybrid is not None
        swa_allocator = SWATokenToKVPoolAllocator(
            pool_cfg.full_size_tokens, pool_cfg.swa_size_tokens, ps, device, strict=config.strict
        )
        full = MHATokenToKVPool(
            pool_cfg.full_size_tokens,
            ps,
            shape.dtype,
            shape.num_kv_heads,
            shape.head_dim,
            shape.num_full_layers,
            device,
            name="full",
        )
        swa = MHATokenToKVPool(
            pool_cfg.swa_size_tokens,
            ps,
            shape.dtype,
            shape.num_kv_heads,
            shape.head_dim,
            shape.num_swa_layers,
            device,
            name="swa",
        )
        swa_kv_pool = SWAKVPool(full, swa, list(shape.swa_layer_ids), swa_allocator.full_to_swa_index_mapping)
        swa_allocator.recorder = recorder
        swa_cache = spec.build_hybrid(CacheParts(config, swa_allocator, rows, None, window_len, recorder))
        return SWAMemorySystem(config, rows, swa_allocator, swa_kv_pool, swa_cache, window_len)
    allocator = make_token_allocator(pool_cfg.full_size_tokens, ps, device, strict=config.strict)
    kv_pool = MHATokenToKVPool(
        pool_cfg.full_size_tokens, ps, shape.dtype, shape.num_kv_heads, shape.head_dim, shape.num_full_layers, device
    )
    allocator.recorder = recorder
    parts = CacheParts(config, allocator, rows, kv_pool, None, recorder)
    if spec.build_host is not None:
        return HiMemorySystem(config, rows, allocator, kv_pool, spec.build_host(parts))
    assert spec.build_full is not None
    return MemorySystem(config, rows, allocator, kv_pool, spec.build_full(parts))
