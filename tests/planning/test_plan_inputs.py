"""What `plan` accepts as a model and as memory: every preset by name or by the Hugging Face ids
of its checkpoints (any case), a config.json or the folder holding one, and inputs that are
finite; anything else is one ValueError line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvscope.planning import GIB, HF_IDS, PRESETS, PlanInputs, plan_memory, resolve_model


@pytest.mark.parametrize(("name", "hf_id"), [(name, hf_id) for name, ids in HF_IDS.items() for hf_id in ids])
def test_a_presets_hugging_face_id_resolves_to_it_in_any_case(name: str, hf_id: str) -> None:
    assert resolve_model(hf_id) is PRESETS[name]
    assert resolve_model(hf_id.upper()) is PRESETS[name] and resolve_model(f" {hf_id.lower()} ") is PRESETS[name]


def test_every_preset_names_its_checkpoints() -> None:
    assert set(HF_IDS) == set(PRESETS)
    for name, ids in HF_IDS.items():
        assert any(hf_id.lower() in PRESETS[name].source.lower() for hf_id in ids), name


def test_a_given_weight_size_overrides_the_presets_under_its_hf_id() -> None:
    shape = resolve_model("meta-llama/Llama-3.1-8B-Instruct", 10 * GIB)
    assert shape.weights_bytes == 10 * GIB and shape.num_layers == PRESETS["llama-3.1-8b"].num_layers


def test_an_unknown_id_says_what_is_accepted() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown model 'meta-llama/Llama-9-1T': a preset \(llama-3.1-8b.*\), a "
        r"preset's Hugging Face id .* or a config.json file \(nothing is "
        r"downloaded\)",
    ):
        resolve_model("meta-llama/Llama-9-1T")


def test_a_folder_holding_a_config_json_is_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256})
    )
    shape = resolve_model(str(tmp_path), GIB)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 64)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("swa_full_tokens_ratio", math.inf, "swa_full_tokens_ratio must be a finite number > 0, got inf"),
        ("swa_full_tokens_ratio", math.nan, "swa_full_tokens_ratio must be a finite number > 0, got nan"),
        ("mem_fraction_static", math.nan, "mem_fraction_static must be in"),
        ("gpu_memory_utilization", math.inf, "gpu_memory_utilization must be in"),
    ],
)
def test_plan_inputs_are_finite(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_memory(PlanInputs(PRESETS["gemma-3-12b"], 80 * GIB, 80 * GIB, **{field: value}))  # type: ignore[arg-type]
