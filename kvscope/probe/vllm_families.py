"""The vLLM probe's families: per release line, the shapes of vLLM's code it expects (vllm_shapes.py) and
which wrapper (vllm_hooks.py) goes on which target; FAMILIES, newest first, is what vllm.py patches from
(shapes.choose)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscope.probe.core import Target
from kvscope.probe.shapes import Family
from kvscope.probe.vllm_hooks import (
    _add_local_computed_blocks,
    _allocate_slots,
    _append_n,
    _cache_full_blocks,
    _drain_deferred_frees,
    _engine_shutdown,
    _engine_step,
    _for_group,
    _for_request,
    _free_blocks,
    _free_request,
    _free_request_blocks,
    _get_computed_blocks,
    _get_new_blocks,
    _hit_bound_033,
    _hit_bound_034,
    _idle_callbacks,
    _maybe_evict,
    _preempt_request,
    _reset_prefix_cache,
    _touch,
)
from kvscope.probe.vllm_shapes import BLOCK_POOL, CORE, MANAGER, SCHEDULER, SINGLE, UTILS, shapes

Factory = Callable[[Callable[..., Any]], Callable[..., Any]]


def _targets(free_blocks: Factory, get_computed_blocks: Factory) -> list[Target]:
    """What the probe wraps (file:line in docs/probe.md); the families differ in two wrappers."""
    return [
        Target(BLOCK_POOL, "BlockPool", "get_new_blocks", _get_new_blocks),
        Target(BLOCK_POOL, "BlockPool", "_maybe_evict_cached_block", _maybe_evict),
        Target(BLOCK_POOL, "BlockPool", "touch", _touch),
        Target(BLOCK_POOL, "BlockPool", "free_blocks", free_blocks),
        Target(BLOCK_POOL, "BlockPool", "cache_full_blocks", _cache_full_blocks),
        Target(BLOCK_POOL, "BlockPool", "reset_prefix_cache", _reset_prefix_cache),
        Target(UTILS, "FreeKVCacheBlockQueue", "append_n", _append_n),
        Target(MANAGER, "KVCacheManager", "get_computed_blocks", get_computed_blocks),
        Target(MANAGER, "KVCacheManager", "allocate_slots", _allocate_slots),
        Target(MANAGER, "KVCacheManager", "cache_blocks", _for_request),
        Target(MANAGER, "KVCacheManager", "free", _for_request),
        Target(SINGLE, "SingleTypeKVCacheManager", "allocate_new_blocks", _for_group),
        Target(SINGLE, "SingleTypeKVCacheManager", "add_local_computed_blocks", _add_local_computed_blocks),
        Target(SINGLE, "SingleTypeKVCacheManager", "free", _for_group),
        Target(SINGLE, "SingleTypeKVCacheManager", "_remove_blocks_in_range", _for_group),
        Target(SCHEDULER, "Scheduler", "_preempt_request", _preempt_request),
        Target(SCHEDULER, "Scheduler", "_free_request", _free_request),
        Target(SCHEDULER, "Scheduler", "_free_request_blocks", _free_request_blocks),
        Target(SCHEDULER, "Scheduler", "_drain_deferred_frees", _drain_deferred_frees),
        Target(CORE, "EngineCoreProc", "_process_engine_step", _engine_step),
        Target(CORE, "EngineCoreProc", "_notify_idle_state_callbacks", _idle_callbacks),
        Target(CORE, "EngineCore", "shutdown", _engine_shutdown),
    ]


def targets() -> list[Target]:
    """Family 0.30's targets (vLLM 0.30.0 to 0.32.0)."""
    return _targets(_free_blocks, _get_computed_blocks)


def targets_033() -> list[Target]:
    return _targets(_free_blocks, lambda original: _get_computed_blocks(original, _hit_bound_033))


def targets_034() -> list[Target]:
    return _targets(
        lambda original: _free_blocks(original, weak_pool=True),
        lambda original: _get_computed_blocks(original, _hit_bound_034),
    )


# NOTE: newest first (docs/probe.md's version table: each release, its family, the tests that ran on it)
FAMILIES: tuple[Family, ...] = (
    Family(
        "0.34",
        ("0.34.0",),
        shapes(
            free_params=("self", "ordered_blocks", "evict_first"),
            lookup_params=("self", "request", "max_cache_hit_length"),
            pool_reads=("num_hash_lookahead_tokens", "_weak_self"),
            request_reads=("prefix_cache_hit_limit",),
        ),
        targets_034,
    ),
    Family(
        "0.33",
        ("0.33.0",),
        shapes(
            free_params=("self", "ordered_blocks"),
            lookup_params=("self", "request", "max_cache_hit_length"),
            pool_reads=("num_hash_lookahead_tokens",),
            request_reads=(),
        ),
        targets_033,
    ),
    Family(
        "0.30",
        ("0.30.0", "0.31.0", "0.32.0"),
        shapes(
            free_params=("self", "ordered_blocks"),
            lookup_params=("self", "request"),
            pool_reads=(),
            request_reads=(),
        ),
        targets,
    ),
)
