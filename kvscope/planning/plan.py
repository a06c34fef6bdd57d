"""A capacity plan: what KV memory a model gets on a GPU under SGLang and vLLM, side by side.

`plan_memory(PlanInputs(...))` -> MemoryPlan; impossible inputs raise ValueError with one line
(weights larger than the GPU, TP that cannot split the heads, no memory left for KV, an SWA
pool smaller than its window). Pure arithmetic: the dashboard imports it.

NOTE: requests of `context_len` tokens that fit at once
    SGLang  full-pool tokens // ceil_ps(L); for hybrid SWA also SWA-pool tokens //
            ceil_ps(min(L, window)) (a lower bound on a request's SWA tokens: SGLang frees
            tokens that left the window lazily)
    vLLM    blocks // ceil(L / block_size)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvscope.planning.memory_math import (
    GIB,
    SGLangSizing,
    TokenBytes,
    VLLMSizing,
    bytes_per_token,
    resolve_kv_dtype,
    sglang_sizing,
    vllm_sizing,
)
from kvscope.planning.model_shape import ModelShape

DEFAULT_MEM_FRACTION_STATIC = 0.88  # SGLang's fallback; its own default depends on GPU size and TP
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


@dataclass(frozen=True)
class PlanInputs:
    model: ModelShape
    gpu_free_bytes: int  # M0: free on one GPU when the engine starts (SGLang's base)
    gpu_total_bytes: int  # one GPU's total memory (vLLM's base)
    tp_size: int = 1
    kv_dtype: str = "auto"
    page_size: int = 1
    mem_fraction_static: float = DEFAULT_MEM_FRACTION_STATIC
    swa_full_tokens_ratio: float = 0.8
    context_len: int = 8192
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    block_size: int = 16
    vllm_activation_bytes: int = 0  # vLLM profiles activations; give them here

    def __post_init__(self) -> None:
        checks = [
            (self.gpu_free_bytes > 0 and self.gpu_total_bytes > 0, "GPU memory must be > 0"),
            (self.gpu_free_bytes <= self.gpu_total_bytes, "free GPU memory cannot exceed the total"),
            (self.tp_size >= 1, f"TP size must be >= 1, got {self.tp_size}"),
            (_power_of_two(self.page_size), f"page size must be a power of two, got {self.page_size}"),
            (_power_of_two(self.block_size), f"block size must be a power of two, got {self.block_size}"),
            (
                0 < self.mem_fraction_static < 1,
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}",
            ),
            (
                0 < self.gpu_memory_utilization <= 1,
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
            ),
            (
                0 < self.swa_full_tokens_ratio < math.inf,
                f"swa_full_tokens_ratio must be a finite number > 0, got {self.swa_full_tokens_ratio}",
            ),
            (self.context_len >= 1, f"context length must be >= 1, got {self.context_len}"),
            (self.vllm_activation_bytes >= 0, "vLLM activation memory must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.model.weights_bytes is None:
            raise ValueError(f"the weights of {self.model.name} are unknown: give their size (--weights-gib)")

    @property
    def weights_per_gpu_bytes(self) -> int:
        assert self.model.weights_bytes is not None
        return -(-self.model.weights_bytes // self.tp_size)


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclass(frozen=True)
class MemoryPlan:
    inputs: PlanInputs
    kv_dtype: str  # resolved ("auto" -> the model's)
    token_bytes: TokenBytes
    sglang: SGLangSizing
    vllm: VLLMSizing | None  # None: hybrid SWA (not modelled)

    @property
    def sglang_requests_at_context(self) -> int:
        ps, length = self.inputs.page_size, self.inputs.context_len
        fit = self.sglang.max_total_num_tokens // _ceil_to(length, ps)
        window = self.inputs.model.sliding_window
        if self.token_bytes.num_swa_layers and window:
            fit = min(fit, self.sglang.swa_tokens // _ceil_to(min(length, window), ps))
        return fit

    @property
    def vllm_requests_at_context(self) -> int | None:
        if self.vllm is None:
            return None
        return self.vllm.num_gpu_blocks // -(-self.inputs.context_len // self.vllm.block_size)

    def to_dict(self) -> dict[str, Any]:
        m, i = self.inputs.model, self.inputs
        return {
            "model": {"name": m.name, "shape": m.describe(), "source": m.source, "weights_bytes": m.weights_bytes},
            "gpu": {"free_bytes": i.gpu_free_bytes, "total_bytes": i.gpu_total_bytes},
            "tp_size": i.tp_size,
            "kv_dtype": self.kv_dtype,
            "page_size": i.page_size,
            "context_len": i.context_len,
            "weights_per_gpu_bytes": i.weights_per_gpu_bytes,
            "bytes_per_token": {**self.token_bytes._asdict(), "all_layers": self.token_bytes.all_layers_bytes},
            "sglang": {
                **self.sglang._asdict(),
                "num_pages": self.sglang.num_pages,
                "requests_at_context": self.sglang_requests_at_context,
                "swa_full_tokens_ratio": i.swa_full_tokens_ratio if self.token_bytes.num_swa_layers else None,
            },
            "vllm": None
            if self.vllm is None
            else {
                **self.vllm._asdict(),
                "num_tokens": self.vllm.num_tokens,
                "requests_at_context": self.vllm_requests_at_context,
                "activation_bytes": i.vllm_activation_bytes,
            },
        }


def _ceil_to(num_tokens: int, multiple: int) -> int:
    return -(-num_tokens // multiple) * multiple


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """The plan for one GPU of a TP group (every rank alike); see the module doc for errors."""
    kv_dtype, _ = resolve_kv_dtype(inputs.kv_dtype, inputs.model.dtype)
    token_bytes = bytes_per_token(inputs.model, kv_dtype, inputs.tp_size)
    weights = inputs.weights_per_gpu_bytes
    if weights >= inputs.gpu_free_bytes:
        raise ValueError(
            f"the weights of {inputs.model.name} ({weights / GIB:.2f} GiB per GPU at TP {inputs.tp_size}) "
            f"do not fit in the {inputs.gpu_free_bytes / GIB:.2f} GiB free on the GPU"
        )
    sglang = sglang_sizing(
        token_bytes,
        inputs.gpu_free_bytes,
        weights,
        inputs.mem_fraction_static,
        inputs.page_size,
        inputs.swa_full_tokens_ratio,
    )
    window = inputs.model.sliding_window
    if token_bytes.num_swa_layers and window and sglang.swa_tokens <= window + inputs.page_size:
        raise ValueError(
            f"the SWA pool ({sglang.swa_tokens} tokens) must exceed the window + one page "
            f"({window + inputs.page_size}); SGLang would not start"
        )
    vllm = vllm_sizing(
        token_bytes,
        inputs.gpu_total_bytes,
        weights,
        inputs.gpu_memory_utilization,
        inputs.block_size,
        inputs.vllm_activation_bytes,
    )
    return MemoryPlan(inputs, kv_dtype, token_bytes, sglang, vllm)
