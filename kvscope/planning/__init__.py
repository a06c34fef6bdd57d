"""Capacity planning: KV byte math, model presets, the GPU probe, and hit rate vs capacity.

The math (memory_math, model_shape, presets, plan, gpu), the one-pass curve (curve,
stack_distance, requests) and the replays' configs and worker pool (replays) import no torch,
so the dashboard and `kvscope plan` / `kvscope replay` can use them. A brute-force replay
itself (`replay`) needs the radix cache and torch: it loads on first use of that name, and
`replay_many` loads it in its worker processes.

    requests = load_requests("trace.jsonl")               # a JSONL trace or a capture
    curve = one_pass_curve(requests, page_size=16)        # hit rate at every capacity, one pass
    capacities, hits = curve.breakpoints()                # plot hits / curve.num_prompt_tokens
    plan = plan_memory(PlanInputs(resolve_model("llama-3.1-8b"), free_bytes, total_bytes))
    curve.hit_rate(plan.sglang.max_total_num_tokens)      # this traffic's hit rate on that GPU
    isolated = one_pass_curve(requests, isolated=True)    # keys per principal (user): k = inf isolation
"""

from __future__ import annotations

from typing import Any

from kvscope.planning.curve import EXACTNESS, SHARING_NAMES, CacheCurves, HitRateCurve, cache_curves, one_pass_curve
from kvscope.planning.gpu import GpuInfo, probe_gpus
from kvscope.planning.memory_math import (
    GIB,
    KV_DTYPES,
    SGLangSizing,
    TokenBytes,
    VLLMSizing,
    bytes_per_token,
    kv_heads_per_rank,
    resolve_kv_dtype,
    sglang_sizing,
    vllm_sizing,
)
from kvscope.planning.model_shape import ModelShape, load_hf_config, shape_from_hf_config
from kvscope.planning.plan import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MEM_FRACTION_STATIC,
    MemoryPlan,
    PlanInputs,
    plan_memory,
)
from kvscope.planning.presets import HF_IDS, PRESETS, resolve_model
from kvscope.planning.replays import (
    CONVENTION_MEANINGS,
    CONVENTIONS,
    ReplayConfig,
    ReplayResult,
    ScopedOptions,
    ceil_pages,
    replay_many,
)
from kvscope.planning.report import format_plan, format_replay, gpu_line
from kvscope.planning.requests import (
    ReplayRequest,
    ReplaySource,
    load_requests,
    load_source,
    replay_requests,
    trace_times_s,
)

_REPLAY_NAMES = ("replay",)


def __getattr__(name: str) -> Any:
    if name in _REPLAY_NAMES:
        import importlib

        return getattr(importlib.import_module("kvscope.planning.brute_force"), name)
    raise AttributeError(f"module 'kvscope.planning' has no attribute {name!r}")


__all__ = [
    "CONVENTIONS",
    "CONVENTION_MEANINGS",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_MEM_FRACTION_STATIC",
    "EXACTNESS",
    "GIB",
    "HF_IDS",
    "KV_DTYPES",
    "PRESETS",
    "SHARING_NAMES",
    "CacheCurves",
    "GpuInfo",
    "HitRateCurve",
    "MemoryPlan",
    "ModelShape",
    "PlanInputs",
    "ReplayConfig",
    "ReplayRequest",
    "ReplayResult",
    "ReplaySource",
    "SGLangSizing",
    "ScopedOptions",
    "TokenBytes",
    "VLLMSizing",
    "bytes_per_token",
    "cache_curves",
    "ceil_pages",
    "format_plan",
    "format_replay",
    "gpu_line",
    "kv_heads_per_rank",
    "load_hf_config",
    "load_requests",
    "load_source",
    "one_pass_curve",
    "plan_memory",
    "probe_gpus",
    "replay",
    "replay_many",
    "replay_requests",
    "resolve_kv_dtype",
    "resolve_model",
    "sglang_sizing",
    "shape_from_hf_config",
    "trace_times_s",
    "vllm_sizing",
]
