"""Capacity planning: KV byte math, model presets, the GPU probe, and hit rate vs capacity.

The math (memory_math, model_shape, presets, plan, gpu) and the one-pass curve (curve,
stack_distance, requests) import no torch, so the dashboard can use them. The brute-force
replays (`replay`, `replay_many`, `ReplayConfig`, `ReplayResult`) need the radix cache and
torch: they load on first use of those names.

    requests = load_requests("trace.jsonl")               # a JSONL trace or a capture
    curve = one_pass_curve(requests, page_size=16)        # hit rate at every capacity, one pass
    capacities, hits = curve.breakpoints()                # plot hits / curve.num_prompt_tokens
    plan = plan_memory(PlanInputs(resolve_model("llama-3.1-8b"), free_bytes, total_bytes))
    curve.hit_rate(plan.sglang.max_total_num_tokens)      # this traffic's hit rate on that GPU
"""

from __future__ import annotations

from typing import Any

from kvscope.planning.curve import EXACTNESS, HitRateCurve, one_pass_curve
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
from kvscope.planning.presets import PRESETS, resolve_model
from kvscope.planning.report import format_plan, format_replay, gpu_line
from kvscope.planning.requests import ReplayRequest, load_requests, replay_requests

_REPLAY_NAMES = ("ReplayConfig", "ReplayResult", "replay", "replay_many")


def __getattr__(name: str) -> Any:
    if name in _REPLAY_NAMES:
        import importlib

        return getattr(importlib.import_module("kvscope.planning.brute_force"), name)
    raise AttributeError(f"module 'kvscope.planning' has no attribute {name!r}")


__all__ = [
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_MEM_FRACTION_STATIC",
    "EXACTNESS",
    "GIB",
    "KV_DTYPES",
    "PRESETS",
    "GpuInfo",
    "HitRateCurve",
    "MemoryPlan",
    "ModelShape",
    "PlanInputs",
    "ReplayConfig",
    "ReplayRequest",
    "ReplayResult",
    "SGLangSizing",
    "TokenBytes",
    "VLLMSizing",
    "bytes_per_token",
    "format_plan",
    "format_replay",
    "gpu_line",
    "kv_heads_per_rank",
    "load_hf_config",
    "load_requests",
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
    "vllm_sizing",
]
