"""What kvscope's vLLM probe needs of vLLM's code, as shapes (kvscope/probe/shapes.py): every method it
wraps with the leading parameters its wrapper passes or reads, and the attributes the probe, its census
(vllm_views.py) and its tree snapshots read on vLLM's objects. The families in vllm_families.py pair these
with their wrappers; a release that differs in any of them patches nothing.

NOTE: imports nothing of vLLM: `kvscope probe-check` describes a release's code before it runs.
"""

from __future__ import annotations

from kvscope.probe.shapes import Shape

BLOCK_POOL = "vllm.v1.core.block_pool"
MANAGER = "vllm.v1.core.kv_cache_manager"
SINGLE = "vllm.v1.core.single_type_kv_cache_manager"
SCHEDULER = "vllm.v1.core.sched.scheduler"
CORE = "vllm.v1.engine.core"
UTILS = "vllm.v1.core.kv_cache_utils"


_REQUEST_READS = (
    "request_id",
    "num_tokens",
    "num_prompt_tokens",
    "num_output_tokens",
    "arrival_time",
    "status",
    "is_finished",
    "get_finished_reason",
)
_POOL_READS = ("blocks", "free_block_queue", "num_gpu_blocks", "hash_block_size", "enable_caching")


def shapes(
    *,
    free_params: tuple[str, ...],
    lookup_params: tuple[str, ...],
    pool_reads: tuple[str, ...],
    request_reads: tuple[str, ...],
) -> tuple[Shape, ...]:
    pool, utils, manager = f"{BLOCK_POOL}.BlockPool", f"{UTILS}", f"{MANAGER}.KVCacheManager"
    single, sched, core = f"{SINGLE}.SingleTypeKVCacheManager", f"{SCHEDULER}.Scheduler", CORE
    return (
        Shape(f"{pool}.get_new_blocks", ("self", "num_blocks"), _POOL_READS + pool_reads),
        Shape(f"{pool}._maybe_evict_cached_block", ("self", "block")),
        Shape(f"{pool}.touch", ("self", "blocks")),
        Shape(f"{pool}.free_blocks", free_params),
        Shape(
            f"{pool}.cache_full_blocks",
            ("self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id"),
        ),
        Shape(f"{pool}.reset_prefix_cache", ("self",)),
        Shape(f"{utils}.KVCacheBlock", (), ("block_id", "ref_cnt", "pool", "block_hash", "is_null", "next_free_block")),
        Shape(
            f"{utils}.FreeKVCacheBlockQueue.append_n",
            ("self", "blocks"),
            ("num_free_blocks", "fake_free_list_head", "fake_free_list_tail"),
        ),
        Shape(f"{manager}.get_computed_blocks", lookup_params, ("block_pool", "coordinator", "use_eagle")),
        Shape(f"{manager}.prefix_cache_lookup_enabled", ("self", "request")),
        Shape(f"{manager}.allocate_slots", ("self", "request", "num_new_tokens")),
        Shape(f"{manager}.cache_blocks", ("self", "request")),
        Shape(f"{manager}.free", ("self", "request")),
        Shape(
            f"{single}.allocate_new_blocks",
            ("self", "request_id"),
            ("req_to_blocks", "block_size", "kv_cache_group_id"),
        ),
        Shape(f"{single}.add_local_computed_blocks", ("self", "request_id", "new_computed_blocks")),
        Shape(f"{single}.free", ("self", "request_id")),
        Shape(f"{single}._remove_blocks_in_range", ("self", "request_id")),
        Shape(f"{sched}._preempt_request", ("self", "request"), ("kv_cache_manager", "requests", "running", "waiting")),
        Shape(f"{sched}._free_request", ("self", "request")),
        Shape(f"{sched}._free_request_blocks", ("self", "request"), ("deferred_frees",)),
        Shape(f"{sched}._drain_deferred_frees", ("self",), ("processed_step_seq",)),
        Shape(f"{core}.EngineCoreProc._process_engine_step", ("self",), ("scheduler", "vllm_config", "has_work")),
        Shape(f"{core}.EngineCoreProc._notify_idle_state_callbacks", ("self",)),
        Shape(f"{core}.EngineCore.shutdown", ("self",)),
        Shape("vllm.v1.request.Request", (), _REQUEST_READS + request_reads),
    )
