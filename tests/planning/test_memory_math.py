"""KV memory math against hand computations for every preset: bytes per token (TP split and
replication, MLA, hybrid SWA, dtypes), SGLang's max_total_num_tokens and vLLM's blocks, the
config.json reader, and impossible inputs as one-line errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvscope.planning import (
    GIB,
    PRESETS,
    PlanInputs,
    bytes_per_token,
    load_hf_config,
    plan_memory,
    resolve_kv_dtype,
    resolve_model,
)
from kvscope.planning.gpu import GpuInfo, probe_gpus, visible

# (preset, kv dtype, tp) -> bytes per token per GPU, by hand: heads_per_rank x (K + V dims) x bytes x layers
HAND_BYTES_PER_TOKEN = [
    ("llama-3.1-8b", "bf16", 1, 8 * (128 + 128) * 2 * 32),  # 131,072 (docs/capacity-planning.md §4)
    ("llama-3.1-8b", "fp8", 1, 8 * 256 * 1 * 32),
    ("llama-3.1-8b", "fp32", 2, 4 * 256 * 4 * 32),
    ("llama-3-70b", "bf16", 1, 8 * 256 * 2 * 80),
    ("llama-3-70b", "bf16", 8, 1 * 256 * 2 * 80),  # 40,960
    ("llama-3-70b", "bf16", 16, 1 * 256 * 2 * 80),  # heads replicated: TP 16 gains nothing
    ("qwen2.5-7b", "bf16", 1, 4 * 256 * 2 * 28),  # 57,344
    ("qwen2.5-7b", "bf16", 4, 1 * 256 * 2 * 28),
    ("deepseek-v3", "bf16", 1, (512 + 64) * 2 * 61),  # 70,272: one latent, no x2
    ("deepseek-v3", "bf16", 8, (512 + 64) * 2 * 61),  # no TP split
    ("deepseek-v3", "fp8_e4m3", 8, (512 + 64) * 1 * 61),  # 35,136
]


@pytest.mark.parametrize(("name", "kv_dtype", "tp", "expected"), HAND_BYTES_PER_TOKEN)
def test_bytes_per_token_match_hand_computation(name: str, kv_dtype: str, tp: int, expected: int) -> None:
    token_bytes = bytes_per_token(PRESETS[name], kv_dtype, tp)
    assert token_bytes.all_layers_bytes == expected
    assert token_bytes.swa_bytes == 0 and token_bytes.cell_bytes() == expected


def test_hybrid_swa_presets_split_full_and_window_layers() -> None:
    gemma = bytes_per_token(PRESETS["gemma-3-12b"], "auto", 1)  # 8 full + 40 SWA layers, 8 KV heads x 256
    assert (gemma.full_bytes, gemma.swa_bytes) == (8 * 512 * 2 * 8, 8 * 512 * 2 * 40)
    assert gemma.cell_bytes(0.8) == 65_536 + 0.8 * 327_680
    gpt_oss = bytes_per_token(PRESETS["gpt-oss-20b"], "bf16", 2)  # 12 + 12 layers, 8 KV heads x 64 over TP 2
    assert (gpt_oss.full_bytes, gpt_oss.swa_bytes) == (4 * 128 * 2 * 12, 4 * 128 * 2 * 12)
    assert gpt_oss.cell_bytes(0.5) == 12_288 + 0.5 * 12_288


def test_sglang_and_vllm_sizes_match_hand_computation() -> None:
    gpu = 80 * GIB
    plan = plan_memory(PlanInputs(PRESETS["llama-3.1-8b"], gpu, gpu, page_size=16, mem_fraction_static=0.88))
    rest = int(gpu * 0.88) - 16_060_000_000  # M0 x mfs - weights
    assert plan.sglang.kv_pool_bytes == rest
    assert plan.sglang.max_total_num_tokens == rest // 131_072 // 16 * 16 == 454_176
    assert plan.sglang.num_pages == 454_176 // 16
    assert plan.sglang_requests_at_context == 454_176 // 8192
    blocks = (77_309_411_328 - 16_060_000_000) // (16 * 4096) // 32  # ceil(80 GiB x 0.9) - weights
    assert plan.vllm is not None and plan.vllm.num_gpu_blocks == blocks and plan.vllm.num_tokens == blocks * 16
    assert plan.vllm_requests_at_context == blocks // (8192 // 16)


def test_sglang_hybrid_pools_and_requests_that_fit() -> None:
    gpu = 80 * GIB
    inputs = PlanInputs(PRESETS["gemma-3-12b"], gpu, gpu, swa_full_tokens_ratio=0.5, context_len=4096)
    plan = plan_memory(inputs)
    rest = int(gpu * 0.88) - 24_370_000_000
    full = int(rest // (65_536 + 0.5 * 327_680))
    assert plan.sglang.max_total_num_tokens == full and plan.sglang.swa_tokens == int(full * 0.5)
    assert plan.sglang_requests_at_context == min(full // 4096, int(full * 0.5) // 1024)
    assert plan.vllm is None and plan.vllm_requests_at_context is None


def test_tensor_parallel_divides_weights_across_ranks() -> None:
    gpu = 80 * GIB
    plan = plan_memory(PlanInputs(PRESETS["llama-3-70b"], gpu, gpu, tp_size=8))
    assert plan.inputs.weights_per_gpu_bytes == 141_100_000_000 // 8
    assert plan.sglang.max_total_num_tokens == (int(gpu * 0.88) - 17_637_500_000) // 40_960


@pytest.mark.parametrize(
    ("name", "tp", "gpu_gib", "message"),
    [
        ("llama-3.1-8b", 3, 80, "TP 3 does not divide the 32 attention heads"),
        ("qwen2.5-7b", 7, 80, "TP 7 and the 4 KV heads of qwen2.5-7b must divide one another"),
        ("deepseek-v3", 3, 80, "TP 3 does not divide the 128 attention heads"),
        ("llama-3-70b", 1, 80, "do not fit in the 80.00 GiB free"),
        ("llama-3.1-8b", 1, 16.5, "leaves no KV memory"),
        ("gpt-oss-20b", 1, (13_800_000_000 + 4_000_000) / 0.88 / GIB, "the SWA pool (72 tokens) must exceed"),
    ],
)
def test_impossible_inputs_are_one_line_errors(name: str, tp: int, gpu_gib: float, message: str) -> None:
    """The last case leaves ~4 MB for KV: 90 full-pool tokens, an SWA pool of 72 < window 128 + 1."""
    gpu = int(gpu_gib * GIB)
    with pytest.raises(ValueError) as err:
        plan_memory(PlanInputs(PRESETS[name], gpu, gpu, tp_size=tp))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_knobs_and_names_are_rejected() -> None:
    gpu = 80 * GIB
    model = PRESETS["llama-3.1-8b"]
    for kwargs in (
        {"page_size": 3},
        {"mem_fraction_static": 1.2},
        {"gpu_memory_utilization": 0},
        {"context_len": 0},
        {"tp_size": 0},
    ):
        with pytest.raises(ValueError):
            PlanInputs(model, gpu, gpu, **kwargs)
    with pytest.raises(ValueError, match="weights of x are unknown"):
        PlanInputs(replace(model, name="x", weights_bytes=None), gpu, gpu)
    with pytest.raises(ValueError, match="unknown KV dtype 'int3'"):
        resolve_kv_dtype("int3")
    with pytest.raises(ValueError, match="unknown model 'llama-9'"):
        resolve_model("llama-9")
    assert resolve_kv_dtype("auto", "bf16") == ("bf16", 2) and resolve_kv_dtype("float16") == ("fp16", 2)
    assert resolve_model("LLaMA-3.1-8B", weights_bytes=5).weights_bytes == 5


# NOTE: the published config.json fields of each preset (only those the reader looks at)
HF_CONFIGS = {
    "llama-3.1-8b": {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "torch_dtype": "bfloat16",
    },
    "llama-3-70b": {
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "hidden_size": 8192,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    "gemma-3-12b": {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "torch_dtype": "bfloat16",
        "text_config": {
            "num_hidden_layers": 48,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "hidden_size": 3840,
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
        },
    },
    "gpt-oss-20b": {
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_size": 2880,
        "sliding_window": 128,
        "torch_dtype": "bfloat16",
        "layer_types": ["sliding_attention", "full_attention"] * 12,
    },
    "deepseek-v3": {
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "hidden_size": 7168,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "torch_dtype": "bfloat16",
    },
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_config_json_gives_the_presets_kv_bytes(tmp_path: Path, name: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS[name]))
    shape = load_hf_config(path, weights_bytes=1)
    preset = PRESETS[name]
    assert (shape.num_swa_layers, shape.sliding_window) == (preset.num_swa_layers, preset.sliding_window)
    for tp in (tp for tp in (1, 2, 4, 8) if preset.num_attention_heads % tp == 0):
        assert bytes_per_token(shape, "auto", tp) == bytes_per_token(preset, "auto", tp), f"TP {tp}"
    assert resolve_model(str(path)).source == str(path)


def test_bad_config_files_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "partial.json").write_text('{"num_attention_heads": 8}')
    for name, message in (
        ("missing.json", "No such file"),
        ("broken.json", "not valid JSON"),
        ("partial.json", "config has no 'num_hidden_layers'"),
    ):
        with pytest.raises(ValueError, match=message):
            load_hf_config(tmp_path / name)


def test_visible_gpus_follow_cuda_visible_devices() -> None:
    gpus = [GpuInfo(i, "H100", 80 * GIB, 79 * GIB, f"GPU-{i}aaa") for i in range(4)]
    assert visible(gpus, None) == gpus
    assert [g.gpu_index for g in visible(gpus, "2,0")] == [2, 0]
    assert [g.gpu_index for g in visible(gpus, "GPU-3,9,1")] == [3]  # CUDA stops at an invalid entry
    assert visible(gpus, "") == []


def test_probe_without_a_driver_finds_nothing_or_real_gpus() -> None:
    gpus = probe_gpus()
    assert all(g.total_bytes >= g.free_bytes > 0 and g.name for g in gpus)


@pytest.mark.cuda
def test_probe_sees_the_gpu_torch_sees() -> None:
    import torch

    gpus = probe_gpus()
    assert len(gpus) == torch.cuda.device_count()
    _, total = torch.cuda.mem_get_info(0)
    assert gpus[0].total_bytes == total
