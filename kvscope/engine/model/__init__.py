"""The engine's model: a tiny seeded decoder-only transformer whose attention reads and writes
the KV pools through req_to_token, plus the dense reference forward it must match.

Window semantics: a query at position q in an SWA layer attends keys k with
q - sliding_window < k <= q; a full-attention layer attends every k <= q.
"""

from kvscope.engine.model.attention import AttentionMetadata, KVPool, build_attention_metadata, window_mask
from kvscope.engine.model.batch import ForwardBatch, ForwardMode
from kvscope.engine.model.config import MODEL_PRESETS, KVPoolShape, ModelConfig, kv_pool_shape, model_config
from kvscope.engine.model.transformer import TinyTransformer, sample_greedy

__all__ = [
    "MODEL_PRESETS",
    "AttentionMetadata",
    "ForwardBatch",
    "ForwardMode",
    "KVPool",
    "KVPoolShape",
    "ModelConfig",
    "TinyTransformer",
    "build_attention_metadata",
    "kv_pool_shape",
    "model_config",
    "sample_greedy",
    "window_mask",
]
