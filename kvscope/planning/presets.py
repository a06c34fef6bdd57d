"""Model presets: the published attention shapes (each model's config.json) and weight sizes.

NOTE: weights are parameters x bytes per parameter of the released checkpoint, all ranks
together; an estimate (embeddings replicated across TP, vision towers, quantization scales
and the engine's own buffers are not counted). Pass the measured size where it matters.
    llama-3.1-8b   8.03 B params, bf16
    llama-3-70b    70.55 B params, bf16
    qwen2.5-7b     7.62 B params, bf16
    gemma-3-12b    12.19 B params (with the vision tower), bf16; 5 local : 1 global layers
    gpt-oss-20b    ~13.8 GB checkpoint (MoE experts in MXFP4, the rest bf16); alternating layers
    deepseek-v3    671 B params, fp8 (MTP layer not loaded)
Each preset also answers to the Hugging Face ids of the checkpoints with its shape and size
(base and instruct alike; Llama 3.1 and 3.3 70B share Llama 3's), case-insensitive.
"""

from __future__ import annotations

import os
from dataclasses import replace

from kvscope.planning.model_shape import ModelShape, load_hf_config

GB = 10**9

PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(
            "llama-3.1-8b",
            num_layers=32,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            weights_bytes=16_060 * 10**6,
            source="meta-llama/Llama-3.1-8B config.json",
        ),
        ModelShape(
            "llama-3-70b",
            num_layers=80,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=128,
            weights_bytes=141_100 * 10**6,
            source="meta-llama/Meta-Llama-3-70B config.json",
        ),
        ModelShape(
            "qwen2.5-7b",
            num_layers=28,
            num_attention_heads=28,
            num_kv_heads=4,
            head_dim=128,
            weights_bytes=15_230 * 10**6,
            source="Qwen/Qwen2.5-7B config.json",
        ),
        ModelShape(
            "gemma-3-12b",
            num_layers=48,
            num_attention_heads=16,
            num_kv_heads=8,
            head_dim=256,
            sliding_window=1024,
            num_swa_layers=40,
            weights_bytes=24_370 * 10**6,
            source="google/gemma-3-12b-it config.json (text_config)",
        ),
        ModelShape(
            "gpt-oss-20b",
            num_layers=24,
            num_attention_heads=64,
            num_kv_heads=8,
            head_dim=64,
            sliding_window=128,
            num_swa_layers=12,
            weights_bytes=13_800 * 10**6,
            source="openai/gpt-oss-20b config.json",
        ),
        ModelShape(
            "deepseek-v3",
            num_layers=61,
            num_attention_heads=128,
            num_kv_heads=128,
            head_dim=192,
            v_head_dim=128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            weights_bytes=671 * GB,
            source="deepseek-ai/DeepSeek-V3 config.json",
        ),
    )
}


HF_IDS: dict[str, tuple[str, ...]] = {
    "llama-3.1-8b": (
        "meta-llama/Llama-3.1-8B",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Meta-Llama-3.1-8B",
        "meta-llama/Meta-Llama-3.1-8B-Instruct",
    ),
    "llama-3-70b": (
        "meta-llama/Meta-Llama-3-70B",
        "meta-llama/Meta-Llama-3-70B-Instruct",
        "meta-llama/Llama-3.1-70B",
        "meta-llama/Llama-3.1-70B-Instruct",
        "meta-llama/Llama-3.3-70B-Instruct",
    ),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"),
    "gemma-3-12b": ("google/gemma-3-12b-it", "google/gemma-3-12b-pt"),
    "gpt-oss-20b": ("openai/gpt-oss-20b",),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-Base", "deepseek-ai/DeepSeek-V3-0324"),
}
_BY_NAME: dict[str, str] = {
    **{name.lower(): name for name in PRESETS},
    **{hf_id.lower(): name for name, ids in HF_IDS.items() for hf_id in ids},
}


def resolve_model(name_or_path: str, weights_bytes: int | None = None) -> ModelShape:
    """A preset by name or Hugging Face id (case-insensitive), or a config.json file (or a
    folder holding one). `weights_bytes` overrides the preset's."""
    name = _BY_NAME.get(name_or_path.strip().lower())
    if name is not None:
        preset = PRESETS[name]
        return preset if weights_bytes is None else replace(preset, weights_bytes=weights_bytes)
    if os.path.isdir(name_or_path) and os.path.isfile(os.path.join(name_or_path, "config.json")):
        return load_hf_config(os.path.join(name_or_path, "config.json"), weights_bytes)
    if name_or_path.endswith(".json") or os.path.isfile(name_or_path):
        return load_hf_config(name_or_path, weights_bytes)
    raise ValueError(
        f"unknown model {name_or_path!r}: a preset ({', '.join(PRESETS)}), a preset's Hugging Face id "
        "(e.g. meta-llama/Llama-3.1-8B-Instruct), or a config.json file (nothing is downloaded)"
    )
