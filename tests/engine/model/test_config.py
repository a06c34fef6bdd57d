"""ModelConfig validation, presets, shape strings, and the KV pool shape a model needs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvscope.engine.model import MODEL_PRESETS, ModelConfig, kv_pool_shape, model_config


def test_presets_are_a_full_and_a_hybrid_model() -> None:
    tiny, swa = MODEL_PRESETS["tiny"], MODEL_PRESETS["tiny-swa"]
    assert not tiny.is_hybrid and tiny.full_layer_ids == (0, 1, 2, 3)
    assert swa.is_hybrid and swa.sliding_window == 32
    assert swa.swa_layer_ids == (1, 3) and swa.full_layer_ids == (0, 2)
    assert swa.layer_window(1) == 32 and swa.layer_window(2) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_heads": 4, "num_kv_heads": 3}, "divisible by num_kv_heads"),
        ({"hidden_size": 0}, "must be >= 1"),
        ({"head_dim": 15}, "even for RoPE"),
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"swa_layer_ids": (1,)}, "without a sliding_window"),
        ({"sliding_window": 8}, "swa_layer_ids is empty"),
        ({"sliding_window": 0, "swa_layer_ids": (1,)}, "sliding_window must be >= 1"),
        ({"sliding_window": 8, "swa_layer_ids": (4,)}, r"outside \[0, 4\)"),
        ({"sliding_window": 8, "swa_layer_ids": (3, 1)}, "strictly increasing"),
        ({"sliding_window": 8, "swa_layer_ids": (0, 1, 2, 3)}, "at least one full-attention layer"),
    ],
)
def test_invalid_configs_raise_clear_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**overrides)


def test_model_config_takes_a_preset_or_a_shape_string() -> None:
    assert model_config("tiny-swa") is MODEL_PRESETS["tiny-swa"]
    cfg = model_config("layers=6,hidden=32,heads=8,kv_heads=1,head_dim=8,window=16,swa_layers=1:3:5")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (6, 32, 8, 1, 8)
    assert cfg.sliding_window == 16 and cfg.swa_layer_ids == (1, 3, 5) and cfg.full_layer_ids == (0, 2, 4)
    assert cfg.vocab_size == MODEL_PRESETS["tiny"].vocab_size
    over = model_config("tiny-swa, seed=3, dtype=bfloat16, rope_theta=500")
    assert over.seed == 3 and over.torch_dtype == torch.bfloat16 and over.rope_theta == 500.0
    assert over.swa_layer_ids == (1, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("huge", "unknown model preset"),
        ("", "empty model shape"),
        ("layers=four", "bad value"),
        ("depth=4", "expected key=value"),
        ("layers", "unknown model preset"),
        ("tiny,heads", "expected key=value"),
        ("window=8", "swa_layer_ids is empty"),
        ("swa_layers=1:x,window=8", "bad value"),
    ],
)
def test_model_config_rejects_bad_shapes(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_config(text)


def test_kv_pool_shape_splits_full_and_swa_layers() -> None:
    shape = kv_pool_shape(model_config("tiny-swa,dtype=float16"))
    assert (shape.num_kv_heads, shape.head_dim, shape.num_full_layers, shape.num_swa_layers) == (2, 16, 2, 2)
    assert shape.swa_layer_ids == (1, 3) and shape.dtype == torch.float16 and shape.is_hybrid
    plain = kv_pool_shape(MODEL_PRESETS["tiny"])
    assert (plain.num_full_layers, plain.num_swa_layers, plain.is_hybrid) == (4, 0, False)
