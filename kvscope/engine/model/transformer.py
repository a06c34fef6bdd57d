"""TinyTransformer: a decoder-only model (RMSNorm, RoPE, GQA, SwiGLU) reading its KV from the pools.

`forward` runs a ForwardBatch against a ReqToTokenPool and a KV pool; `dense_forward` runs
one sequence with no pool at all and is the reference the paged path must match.
Pools: an MHATokenToKVPool with every layer, or an SWAKVPool whose SWA layers are the
config's (the SWA pool addressed through full_to_swa_index_mapping). A hybrid model on a
plain MHATokenToKVPool keeps its window in the mask only (hybrid memory off).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.engine.model.attention import Attention, AttentionMetadata, KVPool, build_attention_metadata
from kvscope.engine.model.batch import ForwardBatch
from kvscope.engine.model.config import ModelConfig
from kvscope.engine.model.layers import RMSNorm, SwiGLU, linear_weight, seeded_weight
from kvscope.mem import MHATokenToKVPool, ReqToTokenPool, resolve_device


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, generator: torch.Generator) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, generator)
        self.attn = Attention(config, layer_id, generator)
        self.mlp_norm = RMSNorm(config.hidden_size, generator)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, generator)

    def forward_paged(
        self, h: torch.Tensor, batch: ForwardBatch, kv_pool: KVPool, metas: dict[int | None, AttentionMetadata]
    ) -> torch.Tensor:
        h = h + self.attn.forward_paged(self.attn_norm(h), batch, kv_pool, metas[self.attn.window])
        return h + self.mlp(self.mlp_norm(h))

    def forward_dense(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = h + self.attn.forward_dense(self.attn_norm(h), positions)
        return h + self.mlp(self.mlp_norm(h))


class TinyTransformer(nn.Module):
    def __init__(self, config: ModelConfig, device: str | torch.device | None = "cpu") -> None:
        super().__init__()
        self.config = config
        generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self.embed = seeded_weight((config.vocab_size, config.hidden_size), 1.0, generator)
        self.layers: list[DecoderLayer] = nn.ModuleList(  # type: ignore[assignment]
            DecoderLayer(config, i, generator) for i in range(config.num_layers)
        )
        self.final_norm = RMSNorm(config.hidden_size, generator)
        self.lm_head = linear_weight(config.vocab_size, config.hidden_size, generator)
        self.device = resolve_device(device)
        self.to(device=self.device, dtype=config.torch_dtype)

    @torch.no_grad()
    def forward(
        self,
        batch: ForwardBatch,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        *,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """float32 logits [num_requests, vocab] of each request's last new token, or
        [num_tokens, vocab] for every new token with `all_logits`.

        Mutates the KV pool: layer l's K/V of the new tokens land at out_cache_loc
        (translated for SWA layers). Reads only each request's positions that some query of
        this forward can see (attention.py's NOTE), through its req_to_token row.
        """
        self.check_kv_pool(kv_pool)
        metas = self._metadata(batch, req_to_token_pool.req_to_token, kv_pool)
        h = F.embedding(batch.input_ids, self.embed)
        for layer in self.layers:
            h = layer.forward_paged(h, batch, kv_pool, metas)
        if not all_logits:
            last_token = torch.tensor(batch.extend_lens, device=h.device).cumsum(0) - 1
            h = h[last_token]
        return self._logits(h)

    @torch.no_grad()
    def dense_forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Reference: float32 logits [seq, vocab] of one sequence, plain causal/window attention."""
        token_ids = token_ids.to(self.device, torch.int64)
        positions = torch.arange(token_ids.numel(), device=self.device)
        h = F.embedding(token_ids, self.embed)
        for layer in self.layers:
            h = layer.forward_dense(h, positions)
        return self._logits(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.final_norm(h), self.lm_head).float()

    def _metadata(
        self, batch: ForwardBatch, req_to_token: torch.Tensor, kv_pool: KVPool
    ) -> dict[int | None, AttentionMetadata]:
        """One read plan per window kind, shared by all layers of that kind."""
        metas: dict[int | None, AttentionMetadata] = {None: build_attention_metadata(batch, req_to_token, None)}
        window = self.config.sliding_window
        if window is not None:
            metas[window] = build_attention_metadata(batch, req_to_token, window, kv_pool)
        return metas

    def check_kv_pool(self, kv_pool: KVPool) -> None:
        """Raise ValueError unless the pool has this model's layers, heads and head size."""
        cfg = self.config
        for pool in kv_pool.check_layers(cfg.num_layers, cfg.swa_layer_ids):
            check_pool_heads(pool, cfg)


def check_pool_heads(pool: MHATokenToKVPool, config: ModelConfig) -> None:
    got = (pool.num_kv_heads, pool.head_dim, pool.v_head_dim)
    want = (config.num_kv_heads, config.head_dim, config.head_dim)
    if got != want:
        raise ValueError(f"[{pool.name}] KV pool (kv_heads, head_dim, v_head_dim) = {got}, the model needs {want}")


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] int64: the highest logit's token (the first on a tie)."""
    return logits.argmax(dim=-1)
