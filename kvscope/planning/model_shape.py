"""The attention shape of a model, as far as KV memory goes, and reading it from an HF config.json.

NOTE: what a shape says (per token, per layer, before any TP split):
    MHA/GQA/MQA  K and V: num_kv_heads x head_dim each (v_head_dim when it differs)
    MLA          one latent of kv_lora_rank + qk_rope_head_dim (DeepSeek-V2/V3), shared by K and V
    hybrid SWA   num_swa_layers of the num_layers attend only the last sliding_window tokens;
                 the other layers are full attention
Weights are the whole model's bytes (all TP ranks together); None when unknown.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16", "float": "fp32"}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # None: same as head_dim
    kv_lora_rank: int | None = None  # set: MLA
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None  # tokens
    num_swa_layers: int = 0
    weights_bytes: int | None = None
    dtype: str = "bf16"  # the model's own dtype; KV dtype "auto" means this one
    source: str = ""

    def __post_init__(self) -> None:
        counts = {
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }
        bad = {k: v for k, v in counts.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"model {self.name}: sizes must be ints >= 1, got {bad}")
        if self.kv_lora_rank is None and self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name}: {self.num_attention_heads} attention heads are not a multiple of "
                f"the {self.num_kv_heads} KV heads"
            )
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(f"model {self.name}: MLA needs both kv_lora_rank and qk_rope_head_dim")
        if not 0 <= self.num_swa_layers <= self.num_layers:
            raise ValueError(f"model {self.name}: num_swa_layers {self.num_swa_layers} not in [0, {self.num_layers}]")
        if self.num_swa_layers and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"model {self.name}: {self.num_swa_layers} SWA layers need a sliding_window >= 1")
        if self.weights_bytes is not None and self.weights_bytes < 0:
            raise ValueError(f"model {self.name}: weights_bytes must be >= 0, got {self.weights_bytes}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_swa_layers

    @property
    def is_hybrid_swa(self) -> bool:
        return self.num_swa_layers > 0

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        kind = "MHA" if self.num_kv_heads == self.num_attention_heads else "GQA" if self.num_kv_heads > 1 else "MQA"
        return f"{kind}, hybrid SWA" if self.is_hybrid_swa else kind

    def describe(self) -> str:
        if self.is_mla:
            layout = f"latent {self.kv_lora_rank}+{self.qk_rope_head_dim}"
        else:
            layout = f"{self.num_kv_heads} KV heads x {self.head_dim}"
        swa = f", {self.num_swa_layers} SWA layers (window {self.sliding_window})" if self.is_hybrid_swa else ""
        return f"{self.num_layers} layers, {layout}, {self.attention_kind}{swa}"


def load_hf_config(path: str | os.PathLike[str], weights_bytes: int | None = None) -> ModelShape:
    """A model shape from a Hugging Face config.json file (nothing is downloaded)."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise ValueError(f"{name}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{name}: expected a JSON object")
    return shape_from_hf_config(config, name, weights_bytes)


def shape_from_hf_config(config: dict[str, Any], name: str, weights_bytes: int | None = None) -> ModelShape:
    """Fields read: num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (or
    hidden_size / num_attention_heads), kv_lora_rank + qk_rope_head_dim (MLA), v_head_dim,
    sliding_window with layer_types or sliding_window_pattern (hybrid SWA; a window on every
    layer, as Mistral's, is counted as full attention, as SGLang sizes it), torch_dtype. A
    multimodal config's text_config is used when the top level has no layers. Every size read
    must be an integer >= 1: a missing, zero, negative or fractional one is a ValueError naming
    the file and the field."""
    text = config.get("text_config") if "num_hidden_layers" not in config else None
    cfg = {**config, **text} if isinstance(text, dict) else config
    num_layers = _size(cfg, "num_hidden_layers", name)
    heads = _size(cfg, "num_attention_heads", name)
    head_dim = _size(cfg, "head_dim", name, None) or _head_dim_of_hidden(cfg, heads, name)
    mla = cfg.get("kv_lora_rank") is not None
    window, num_swa = _sliding_layers(cfg, num_layers, name)
    return ModelShape(
        name=str(cfg.get("_name_or_path") or name),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=_size(cfg, "num_key_value_heads", name, heads),
        head_dim=head_dim,
        v_head_dim=None if mla else _size(cfg, "v_head_dim", name, None),
        kv_lora_rank=_size(cfg, "kv_lora_rank", name) if mla else None,
        qk_rope_head_dim=_size(cfg, "qk_rope_head_dim", name) if mla else None,
        sliding_window=window,
        num_swa_layers=num_swa,
        weights_bytes=weights_bytes,
        dtype=HF_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bf16"),
        source=name,
    )


_REQUIRED = object()


def _size(cfg: dict[str, Any], key: str, name: str, default: Any = _REQUIRED) -> Any:
    """cfg[key] as an int >= 1; `default` when absent or null (required when none is given)."""
    value = cfg.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{name}: config has no {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 1:
        raise ValueError(f"{name}: config field {key!r} must be an integer >= 1, got {value!r}")
    return int(value)


def _head_dim_of_hidden(cfg: dict[str, Any], heads: int, name: str) -> int:
    hidden = _size(cfg, "hidden_size", name)
    if hidden % heads:
        raise ValueError(
            f"{name}: hidden_size {hidden} is not a multiple of the {heads} attention heads; give head_dim"
        )
    return int(hidden // heads)


def _sliding_layers(cfg: dict[str, Any], num_layers: int, name: str) -> tuple[int | None, int]:
    """(window, number of SWA layers) of a hybrid model; (None, 0) when every layer is full."""
    if not cfg.get("sliding_window") or cfg.get("use_sliding_window") is False:
        return None, 0
    window = _size(cfg, "sliding_window", name)
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        num_swa = sum(1 for t in layer_types if "sliding" in str(t))
    elif cfg.get("sliding_window_pattern"):
        num_swa = num_layers - num_layers // _size(cfg, "sliding_window_pattern", name)  # every Nth layer is full
    else:
        return None, 0
    return (window, num_swa) if 0 < num_swa < num_layers else (None, 0)
