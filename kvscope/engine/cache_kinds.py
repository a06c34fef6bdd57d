"""The registry of prefix-cache kinds: what each needs and how it is built, resolved once.

`--cache` choices and help, the config's validation (which model a kind fits), the fault
checks (a tree, a host tier), the fingerprint (host settings only where there is a host tier),
the scoped and host flags, and `build_memory` all read `cache_kind(name)`; nothing else
branches on a kind's name.

NOTE: a kind builds for a full-attention model (`build_full`, or `build_host` when it brings
a host tier, which makes the memory system a HiMemorySystem) and/or for a hybrid
sliding-window model (`build_hybrid`); None: that model cannot use it.
NOTE: importing this module loads no torch (the `kvscope` parser reads it): each builder
imports its cache where it builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from kvscope.cache import BasePrefixCache, SWAPrefixCache
    from kvscope.cache.hiradix import HiRadixCache
    from kvscope.engine.config import EngineConfig
    from kvscope.mem import ReqToTokenPool
    from kvscope.telemetry import Recorder

CacheKind = Literal["radix", "chunk", "swa-radix", "scoped-radix", "hiradix", "none"]


class CacheParts(NamedTuple):
    """What a builder builds a cache over. `kv_pool`: the device KV pool (full attention);
    `window_len`: the sliding window (hybrid models)."""

    config: EngineConfig
    allocator: Any  # BaseTokenAllocator (full attention) or SWATokenToKVPoolAllocator (hybrid)
    rows: ReqToTokenPool
    kv_pool: Any
    window_len: int | None
    recorder: Recorder


@dataclass(frozen=True)
class CacheKindSpec:
    name: str
    help: str  # one line: what the kind keeps
    build_full: Callable[[CacheParts], BasePrefixCache] | None = None
    build_host: Callable[[CacheParts], HiRadixCache] | None = None
    build_hybrid: Callable[[CacheParts], SWAPrefixCache] | None = None
    has_tree: bool = False
    scoped: bool = False  # takes the tenant options (promote_k .. merge_chains)
    label: str = ""  # how an error names it ("the scoped cache"); the name when empty

    @property
    def has_host(self) -> bool:
        return self.build_host is not None

    @property
    def fits_full(self) -> bool:
        return self.build_full is not None or self.build_host is not None

    @property
    def fits_hybrid(self) -> bool:
        return self.build_hybrid is not None


def _radix(parts: CacheParts) -> BasePrefixCache:
    from kvscope.cache import RadixCache

    config = parts.config
    return RadixCache(
        parts.allocator,
        config.pool.page_size,
        req_to_token_pool=parts.rows,
        eviction_policy=config.cache.eviction_policy,
        eviction_granularity=config.cache.eviction_granularity,
        recorder=parts.recorder,
        strict=config.strict,
    )


def _scoped(parts: CacheParts) -> BasePrefixCache:
    """Its epochs run on the default clock (monotonic time)."""
    from kvscope.cache.scoped import ScopedRadixCache

    config, cache = parts.config, parts.config.cache
    return ScopedRadixCache(
        parts.allocator,
        config.pool.page_size,
        req_to_token_pool=parts.rows,
        eviction_policy=cache.eviction_policy,
        eviction_granularity=cache.eviction_granularity,
        recorder=parts.recorder,
        strict=config.strict,
        promote_k=cache.promote_k,
        epoch_s=cache.epoch_s,
        pinned=cache.pinned,
        dedup=cache.dedup,
        merge_chains=cache.merge_chains,
    )


def _hiradix(parts: CacheParts) -> HiRadixCache:
    """A host pool like the device one, host_tokens or host_ratio x its size (page-aligned, one
    page more: §2.8), and the controller that copies between them."""
    from kvscope.cache.hiradix import HiRadixCache
    from kvscope.mem import CacheController, HostKVPool, HostTokenAllocator, host_pool_tokens

    config, cache, ps = parts.config, parts.config.cache, parts.config.pool.page_size
    size = host_pool_tokens(config.pool.full_size_tokens, ps, ratio=cache.host_ratio, tokens=cache.host_tokens)
    host_allocator = HostTokenAllocator(size, ps, strict=config.strict)
    host_allocator.recorder = parts.recorder
    controller = CacheController(parts.allocator, parts.kv_pool, host_allocator, HostKVPool.like(parts.kv_pool, size))
    return HiRadixCache(
        parts.allocator,
        ps,
        controller,
        write_policy=cache.write_policy,
        req_to_token_pool=parts.rows,
        eviction_policy=cache.eviction_policy,
        recorder=parts.recorder,
        strict=config.strict,
    )


def _chunk(parts: CacheParts) -> BasePrefixCache:
    from kvscope.cache import ChunkCache

    return ChunkCache(
        parts.allocator, parts.config.pool.page_size, req_to_token_pool=parts.rows, recorder=parts.recorder
    )


def _swa_radix(parts: CacheParts) -> SWAPrefixCache:
    from kvscope.cache import SWARadixCache

    assert parts.window_len is not None
    return SWARadixCache(
        parts.allocator,
        parts.config.pool.page_size,
        window_len=parts.window_len,
        req_to_token_pool=parts.rows,
        recorder=parts.recorder,
        strict=parts.config.strict,
    )


def _swa_chunk(parts: CacheParts) -> SWAPrefixCache:
    from kvscope.cache import SWAChunkCache

    assert parts.window_len is not None
    return SWAChunkCache(
        parts.allocator,
        parts.config.pool.page_size,
        req_to_token_pool=parts.rows,
        window_len=parts.window_len,
        recorder=parts.recorder,
    )


CACHE_KINDS: dict[str, CacheKindSpec] = {
    spec.name: spec
    for spec in (
        CacheKindSpec("radix", "SGLang's radix tree", build_full=_radix, has_tree=True),
        CacheKindSpec(
            "chunk", "no reuse: a finished request frees all its KV", build_full=_chunk, build_hybrid=_swa_chunk
        ),
        CacheKindSpec(
            "swa-radix", "the radix tree of hybrid sliding-window models", build_hybrid=_swa_radix, has_tree=True
        ),
        CacheKindSpec(
            "scoped-radix",
            "tenant isolation: nodes private to their principals until promoted",
            build_full=_scoped,
            has_tree=True,
            scoped=True,
            label="scoped",
        ),
        CacheKindSpec("hiradix", "the radix tree over a host tier", build_host=_hiradix, has_tree=True),
        CacheKindSpec("none", "the same as chunk", build_full=_chunk, build_hybrid=_swa_chunk),
    )
}
AUTO = "auto"  # auto_cache_kind: radix, or swa-radix for a hybrid sliding-window model


def cache_kind(name: str) -> CacheKindSpec:
    if name not in CACHE_KINDS:
        raise ValueError(f"cache kind must be one of {', '.join(CACHE_KINDS)}; got {name!r}")
    return CACHE_KINDS[name]


def auto_cache_kind(is_hybrid: bool) -> CacheKind:
    return "swa-radix" if is_hybrid else "radix"


def kinds_with(trait: Callable[[CacheKindSpec], bool]) -> list[str]:
    return [name for name, spec in CACHE_KINDS.items() if trait(spec)]


def either(names: list[str]) -> str:
    """'a, b or c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_fits_model(name: str, is_hybrid: bool) -> None:
    """ValueError when the kind cannot serve this model's attention."""
    spec = cache_kind(name)
    if is_hybrid and not spec.fits_hybrid:
        raise ValueError(
            f"a hybrid sliding-window model needs --cache {either(kinds_with(lambda s: s.fits_hybrid))}, "
            f"not {name} (the {spec.label or name} cache is for full-attention models)"
        )
    if not is_hybrid and not spec.fits_full:
        raise ValueError(f"the {spec.label or name} cache needs a hybrid sliding-window model (e.g. --model tiny-swa)")


def cli_help() -> str:
    """`--cache`'s help: auto and every kind, from the registry."""
    kinds = "; ".join(f"{name}: {spec.help}" for name, spec in CACHE_KINDS.items())
    return (
        f"prefix cache; {AUTO} = {auto_cache_kind(False)}, or {auto_cache_kind(True)} for a sliding-window model; "
        f"{kinds}"
    )
