"""Model shape: a frozen, validated config, named presets, and the KV pool shape it needs.

NOTE: sliding-window semantics. A query at position q in an SWA layer attends keys at
positions k with q - sliding_window < k <= q (the window counts the query itself); a
full-attention layer attends every k <= q.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    sliding_window: int | None = None  # tokens, the query included
    swa_layer_ids: tuple[int, ...] = ()
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        sizes = {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith(("_size", "_dim"))}
        sizes.update(num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
        too_small = {name: value for name, value in sizes.items() if value < 1}
        if too_small:
            raise ValueError(f"model sizes must be >= 1, got {too_small}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self._check_window()

    def _check_window(self) -> None:
        ids = self.swa_layer_ids
        if self.sliding_window is None:
            if ids:
                raise ValueError(f"swa_layer_ids {ids} given without a sliding_window")
            return
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 token, got {self.sliding_window}")
        if not ids:
            raise ValueError("sliding_window set but swa_layer_ids is empty; name the SWA layers")
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"swa_layer_ids must be strictly increasing, got {ids}")
        if ids[0] < 0 or ids[-1] >= self.num_layers:
            raise ValueError(f"swa_layer_ids {ids} outside [0, {self.num_layers})")
        if len(ids) == self.num_layers:
            raise ValueError("every layer is SWA; a hybrid model keeps at least one full-attention layer")

    @property
    def is_hybrid(self) -> bool:
        return self.sliding_window is not None

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.swa_layer_ids)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_bytes_per_layer_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of a layer in tokens, None for full attention."""
        return self.sliding_window if layer_id in self.swa_layer_ids else None


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "tiny-swa": ModelConfig(sliding_window=32, swa_layer_ids=(1, 3)),
}

# Shape-string keys -> config fields; swa_layers is colon-separated layer ids ("1:3" = layers 1 and 3).
SHAPE_KEYS: dict[str, str] = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "layers": "num_layers",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "rope_theta": "rope_theta",
    "window": "sliding_window",
    "swa_layers": "swa_layer_ids",
    "seed": "seed",
    "dtype": "dtype",
}


def model_config(name_or_shape: str) -> ModelConfig:
    """A preset by name, or a shape string such as
    "layers=4,hidden=64,heads=4,kv_heads=2,head_dim=16,window=32,swa_layers=1:3".

    Unnamed fields keep the "tiny" defaults; a shape string may start with a preset name
    to override it ("tiny-swa,seed=3"). Raises ValueError naming the bad part.
    """
    text = name_or_shape.strip()
    if text in MODEL_PRESETS:
        return MODEL_PRESETS[text]
    parts = [p.strip() for p in text.split(",") if p.strip()]
    base = MODEL_PRESETS["tiny"]
    if parts and "=" not in parts[0]:
        if parts[0] not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {parts[0]!r}; presets: {sorted(MODEL_PRESETS)}")
        base = MODEL_PRESETS[parts.pop(0)]
    if not parts:
        raise ValueError(f"empty model shape {name_or_shape!r}; presets: {sorted(MODEL_PRESETS)}")
    overrides = dict(_parse_item(p) for p in parts)
    return replace(base, **overrides)


def _parse_item(item: str) -> tuple[str, Any]:
    key, sep, raw = (s.strip() for s in item.partition("="))
    if not sep or key not in SHAPE_KEYS:
        raise ValueError(f"bad model shape item {item!r}; expected key=value with key in {sorted(SHAPE_KEYS)}")
    name = SHAPE_KEYS[key]
    try:
        if name == "swa_layer_ids":
            return name, tuple(int(x) for x in raw.split(":") if x.strip())
        if name == "sliding_window":
            return name, None if raw.lower() in ("none", "") else int(raw)
        if name == "rope_theta":
            return name, float(raw)
        if name == "dtype":
            return name, raw
        return name, int(raw)
    except ValueError:
        raise ValueError(f"bad value in model shape item {item!r}") from None


class KVPoolShape(NamedTuple):
    """What the engine needs to build the KV pools of a model."""

    num_kv_heads: int
    head_dim: int
    num_full_layers: int
    num_swa_layers: int
    swa_layer_ids: tuple[int, ...]
    dtype: torch.dtype

    @property
    def is_hybrid(self) -> bool:
        return self.num_swa_layers > 0

    @property
    def full_bytes_per_token(self) -> int:
        """K and V of one token over every full-attention layer: what a host-tier copy moves."""
        return 2 * self.num_kv_heads * self.head_dim * self.num_full_layers * self.dtype.itemsize


def kv_pool_shape(config: ModelConfig) -> KVPoolShape:
    return KVPoolShape(
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_full_layers=len(config.full_layer_ids),
        num_swa_layers=len(config.swa_layer_ids),
        swa_layer_ids=config.swa_layer_ids,
        dtype=config.torch_dtype,
    )
