"""KV-cache memory math: bytes per token, SGLang's max_total_num_tokens, vLLM's block count.

Pure arithmetic (no torch, no GPU): the dashboard imports it. Described in
docs/capacity-planning.md §2-§4 and docs/memory-semantics.md §2.2, §5.6, §9.1.

NOTE: formulas, all per GPU (one TP rank), W = weights per GPU = whole model / tp:
    KV heads per rank  H = max(1, num_kv_heads // tp)   (replicated when tp > num_kv_heads)
    MHA/GQA layer      H x (head_dim + v_head_dim) x dtype bytes      (K and V)
    MLA layer          (kv_lora_rank + qk_rope_head_dim) x dtype bytes (no x2, no TP split)
    SGLang cell        F x n_full + ratio x S x n_swa  bytes per full-pool token, where F, S are
                       the bytes of one token in one full / SWA layer, ratio = swa_full_tokens_ratio
    SGLang pool        rest = M1 - M0 x (1 - mfs), M1 = M0 - W   (M0: free memory at start)
                       max_total_num_tokens = page_floor(rest // cell)
                       swa tokens = page_floor(max_total_num_tokens x ratio)
    vLLM pool          requested = ceil(total x gpu_memory_utilization)
                       available = requested - W - activations (profiled by vLLM; given here)
                       num_gpu_blocks = available // (block_size x F) // num_layers
                       tokens = num_gpu_blocks x block_size  (hybrid SWA groups: not modelled)
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kvscope.planning.model_shape import ModelShape

GIB = 2**30
KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
KV_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
KV_DTYPES = ("auto", *KV_DTYPE_BYTES, *KV_DTYPE_ALIASES)


def resolve_kv_dtype(kv_dtype: str, model_dtype: str = "bf16") -> tuple[str, int]:
    """(canonical name, bytes per element); "auto" is the model's own dtype."""
    name = model_dtype if kv_dtype == "auto" else kv_dtype
    name = KV_DTYPE_ALIASES.get(name, name)
    if name not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    return name, KV_DTYPE_BYTES[name]


def kv_heads_per_rank(shape: ModelShape, tp_size: int) -> int:
    """KV heads one TP rank stores; ValueError when TP cannot split the heads (as SGLang's
    QKVParallelLinear requires: TP divides the attention heads, and the KV heads divide TP or TP
    divides them)."""
    if tp_size < 1:
        raise ValueError(f"TP size must be >= 1, got {tp_size}")
    if shape.num_attention_heads % tp_size:
        raise ValueError(
            f"TP {tp_size} does not divide the {shape.num_attention_heads} attention heads of {shape.name}"
        )
    kv = shape.num_kv_heads
    if not shape.is_mla and (tp_size % kv if tp_size >= kv else kv % tp_size):
        raise ValueError(f"TP {tp_size} and the {kv} KV heads of {shape.name} must divide one another")
    return max(1, kv // tp_size)


class TokenBytes(NamedTuple):
    """KV bytes of one token on one GPU."""

    full_layer_bytes: int  # F: one token in one full-attention layer
    swa_layer_bytes: int  # S: one token in one SWA layer (0 without SWA layers)
    num_full_layers: int
    num_swa_layers: int

    @property
    def full_bytes(self) -> int:
        return self.full_layer_bytes * self.num_full_layers

    @property
    def swa_bytes(self) -> int:
        return self.swa_layer_bytes * self.num_swa_layers

    @property
    def all_layers_bytes(self) -> int:
        """A token kept in every layer (a token of a model without SWA layers)."""
        return self.full_bytes + self.swa_bytes

    def cell_bytes(self, swa_full_tokens_ratio: float = 0.8) -> float:
        """SGLang's cell size: bytes per full-pool token, the SWA pool sized at `ratio` of it."""
        return self.full_bytes + swa_full_tokens_ratio * self.swa_bytes


def bytes_per_token(shape: ModelShape, kv_dtype: str = "auto", tp_size: int = 1) -> TokenBytes:
    _, dtype_bytes = resolve_kv_dtype(kv_dtype, shape.dtype)
    if shape.is_mla:
        kv_heads_per_rank(shape, tp_size)  # TP must still divide the attention heads
        assert shape.kv_lora_rank is not None and shape.qk_rope_head_dim is not None
        layer = (shape.kv_lora_rank + shape.qk_rope_head_dim) * dtype_bytes
    else:
        head_dims = shape.head_dim + (shape.v_head_dim or shape.head_dim)
        layer = kv_heads_per_rank(shape, tp_size) * head_dims * dtype_bytes
    return TokenBytes(layer, layer if shape.num_swa_layers else 0, shape.num_full_layers, shape.num_swa_layers)


def page_floor(num_tokens: int, page_size: int) -> int:
    return num_tokens // page_size * page_size


class SGLangSizing(NamedTuple):
    mem_fraction_static: float
    kv_pool_bytes: int  # rest: what the KV pools get on one GPU
    cell_bytes: float
    max_total_num_tokens: int  # full pool, page-floored
    swa_tokens: int  # SWA pool (0 without SWA layers)
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.max_total_num_tokens // self.page_size


def sglang_sizing(
    token_bytes: TokenBytes,
    free_bytes: int,
    weights_per_gpu_bytes: int,
    mem_fraction_static: float,
    page_size: int = 1,
    swa_full_tokens_ratio: float = 0.8,
) -> SGLangSizing:
    """SGLang's pool size from the memory free at start (M0) and the weights on one GPU."""
    rest = int(free_bytes * mem_fraction_static) - weights_per_gpu_bytes
    if rest <= 0:
        share = weights_per_gpu_bytes / free_bytes
        raise ValueError(
            f"mem_fraction_static {mem_fraction_static} leaves no KV memory: the weights take "
            f"{weights_per_gpu_bytes / GIB:.2f} GiB per GPU, {share:.3f} of the {free_bytes / GIB:.2f} "
            f"GiB free; SGLang needs mem_fraction_static above {share:.3f}"
        )
    cell = token_bytes.cell_bytes(swa_full_tokens_ratio)
    full_tokens = page_floor(int(rest // cell), page_size)
    swa_tokens = page_floor(int(full_tokens * swa_full_tokens_ratio), page_size) if token_bytes.num_swa_layers else 0
    return SGLangSizing(mem_fraction_static, rest, cell, full_tokens, swa_tokens, page_size)


class VLLMSizing(NamedTuple):
    gpu_memory_utilization: float
    kv_cache_bytes: int  # available for KV (may be <= 0: vLLM refuses to start)
    block_size: int
    num_gpu_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


def vllm_sizing(
    token_bytes: TokenBytes,
    total_bytes: int,
    weights_per_gpu_bytes: int,
    gpu_memory_utilization: float,
    block_size: int = 16,
    activation_bytes: int = 0,
) -> VLLMSizing | None:
    """vLLM V1's KV cache size on one GPU; None for hybrid SWA models (its layer groups are not modelled)."""
    if token_bytes.num_swa_layers:
        return None
    available = math.ceil(total_bytes * gpu_memory_utilization) - weights_per_gpu_bytes - activation_bytes
    num_layers = token_bytes.num_full_layers
    num_blocks = max(0, available) // (block_size * token_bytes.full_layer_bytes) // num_layers
    return VLLMSizing(gpu_memory_utilization, available, block_size, num_blocks)
