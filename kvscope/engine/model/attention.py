"""Grouped-query attention over the KV pool, and the same attention over a dense sequence.

NOTE: paged read of request i (row r, p prefix tokens, e new, s = p + e, window w):
    queries   positions [p, s)
    keys      positions [kv_start, s): kv_start = 0 in a full layer, max(0, p - w + 1) in an
              SWA layer, the first key any query of this forward can see. Positions before
              kv_start may have had their SWA half freed (mapping 0): never gathered.
    slots     req_to_token[r, kv_start:s]; an SWA layer of an SWAKVPool reads the SWA pool
              at mapping[full_slot] (SWAKVPool.translate_loc), translated once per forward.
The batch is padded to [num_requests, max e] queries x [num_requests, max kv_len] keys so
each layer makes one SDPA call: padded key columns repeat position s - 1 and are masked off,
padded query rows repeat the request's last query and their output is dropped. Nothing
outside [kv_start, s) is ever gathered, so a poisoned (NaN) freed slot cannot leak in.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvscope.engine.model.batch import ForwardBatch
from kvscope.engine.model.config import ModelConfig
from kvscope.engine.model.layers import apply_rope, linear_weight
from kvscope.mem import KVPool


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """True where a query may attend a key: k <= q, and q - window < k in an SWA layer."""
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


class AttentionMetadata(NamedTuple):
    """Where one kind of layer (full, or SWA) reads for one forward batch."""

    read_slots: torch.Tensor  # [num_requests, max_kv_len] rows of the layer's own pool
    mask: torch.Tensor  # [num_requests, 1, max_extend_len, max_kv_len] bool
    query_index: torch.Tensor  # [num_requests, max_extend_len] token index of each padded query
    token_request: torch.Tensor  # [num_tokens] request of each new token
    token_offset: torch.Tensor  # [num_tokens] its row among its request's queries


def build_attention_metadata(
    batch: ForwardBatch, req_to_token: torch.Tensor, window: int | None, kv_pool: KVPool | None = None
) -> AttentionMetadata:
    """Gather slots and masks for layers with `window`; a KV pool translates them for its window layers."""
    device = req_to_token.device
    prefix_a = np.asarray(batch.prefix_lens, dtype=np.int64)
    ext_a = np.asarray(batch.extend_lens, dtype=np.int64)
    start_a = np.zeros_like(prefix_a) if window is None else np.maximum(prefix_a - window + 1, 0)
    kv_len_a = prefix_a + ext_a - start_a
    rows_a = np.asarray(batch.req_pool_indices, dtype=np.int64)
    host = np.stack((prefix_a, ext_a, start_a, kv_len_a, rows_a, np.cumsum(ext_a) - ext_a))
    prefix, ext, start, kv_len, rows, token_start = torch.from_numpy(host).to(device).unbind(0)
    last_pos = (prefix + ext - 1)[:, None]

    k_idx = torch.arange(int(kv_len_a.max()), device=device)
    kv_pos = torch.minimum(start[:, None] + k_idx, last_pos)
    read_slots = req_to_token[rows[:, None], kv_pos].to(torch.int64)
    if kv_pool is not None:
        read_slots = kv_pool.translate_loc(read_slots)

    q_idx = torch.arange(int(ext_a.max()), device=device)
    q_pos = torch.minimum(prefix[:, None] + q_idx, last_pos)
    mask = window_mask(q_pos[:, :, None], kv_pos[:, None, :], window) & (k_idx < kv_len[:, None])[:, None, :]
    query_index = token_start[:, None] + torch.minimum(q_idx, ext[:, None] - 1)
    num_tokens = batch.num_tokens
    token_request = torch.repeat_interleave(torch.arange(len(rows_a), device=device), ext, output_size=num_tokens)
    token_offset = torch.arange(num_tokens, device=device) - token_start[token_request]
    return AttentionMetadata(read_slots, mask[:, None], query_index, token_request, token_offset)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, generator: torch.Generator) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.window = config.layer_window(layer_id)
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        qkv_dim = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv = linear_weight(qkv_dim, config.hidden_size, generator)
        self.o = linear_weight(config.hidden_size, config.num_heads * config.head_dim, generator, gain=0.5)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [tokens, heads, D], k and v [tokens, kv_heads, D]; q and k rotated by position."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv).split((q_dim, kv_dim, kv_dim), dim=-1)
        q = apply_rope(q.reshape(-1, self.num_heads, self.head_dim), positions, self.rope_theta)
        k = apply_rope(k.reshape(-1, self.num_kv_heads, self.head_dim), positions, self.rope_theta)
        return q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, heads, Q, D], k/v [B, kv_heads, K, D], mask [B, 1, Q, K] -> [B, heads, Q, D].

        Query head h reads KV head h // (heads / kv_heads).
        """
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, D] -> [tokens, hidden]."""
        return F.linear(attn.reshape(attn.shape[0], -1), self.o)

    def forward_dense(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention of one whole sequence over itself, no pool."""
        q, k, v = self.project(x, positions)
        mask = window_mask(positions[:, None], positions[None, :], self.window)
        out = self.attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask[None, None])
        return self.output(out[0].transpose(0, 1))

    def forward_paged(
        self, x: torch.Tensor, batch: ForwardBatch, kv_pool: KVPool, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Write the new tokens' K/V at out_cache_loc, then attend through req_to_token."""
        q, k, v = self.project(x, batch.positions)
        kv_pool.set_kv_buffer(self.layer_id, batch.out_cache_loc, k, v)
        k_buffer, v_buffer = kv_pool.get_kv_buffer(self.layer_id)
        keys = k_buffer[meta.read_slots].to(q.dtype).transpose(1, 2)  # [B, kv_heads, max_kv_len, D]
        values = v_buffer[meta.read_slots].to(q.dtype).transpose(1, 2)
        queries = q[meta.query_index].transpose(1, 2)  # [B, heads, max_extend_len, D]
        out = self.attend(queries, keys, values, meta.mask).transpose(1, 2)
        return self.output(out[meta.token_request, meta.token_offset])
