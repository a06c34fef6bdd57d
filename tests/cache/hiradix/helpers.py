"""Shared setup for the two-tier cache tests: real device and host pools, a real controller,
and K/V that encodes (token, position) so any slot can be checked against what it must hold."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvscope.cache import EvictParams
from kvscope.cache.hiradix import HiRadixCache, HiTreeNode, WritePolicy
from kvscope.cache.hiradix.node import hi_walk
from kvscope.mem import (
    BaseTokenAllocator,
    CacheController,
    HostKVPool,
    HostTokenAllocator,
    MHATokenToKVPool,
    ReqToTokenPool,
    make_token_allocator,
)

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 1, 2


@dataclass
class Tiers:
    allocator: BaseTokenAllocator
    device_kv: MHATokenToKVPool
    host_allocator: HostTokenAllocator
    host_kv: HostKVPool
    controller: CacheController
    cache: HiRadixCache

    @property
    def page_size(self) -> int:
        return self.cache.page_size


def make_tiers(
    policy: WritePolicy = "write_through",
    page_size: int = 1,
    device_tokens: int = 64,
    host_tokens: int = 128,
    device: str = "cpu",
    rows: ReqToTokenPool | None = None,
) -> Tiers:
    allocator = make_token_allocator(device_tokens, page_size, device, strict=True)
    assert isinstance(allocator, BaseTokenAllocator)
    device_kv = MHATokenToKVPool(device_tokens, page_size, torch.float32, NUM_HEADS, HEAD_DIM, NUM_LAYERS, device)
    host_allocator = HostTokenAllocator(host_tokens, page_size, strict=True)
    host_kv = HostKVPool.like(device_kv, host_tokens, pin_memory=False)
    controller = CacheController(allocator, device_kv, host_allocator, host_kv)
    cache = HiRadixCache(allocator, page_size, controller, write_policy=policy, req_to_token_pool=rows, strict=True)
    return Tiers(allocator, device_kv, host_allocator, host_kv, controller, cache)


def encoded_kv(ids: np.ndarray, start: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K = (token, position), V = (position, token), both + 100 * layer: [len, heads, dim]."""
    pos = np.arange(start, start + len(ids))
    k = np.stack([ids, pos], axis=1).astype(np.float32) + 100 * layer
    v = np.stack([pos, ids], axis=1).astype(np.float32) + 100 * layer
    return torch.from_numpy(k)[:, None, :], torch.from_numpy(v)[:, None, :]


def write_encoded(t: Tiers, ids: np.ndarray, slots: torch.Tensor, start: int = 0) -> None:
    for layer in range(NUM_LAYERS):
        k, v = encoded_kv(ids, start, layer)
        t.device_kv.set_kv_buffer(layer, slots, k.to(slots.device), v.to(slots.device))


def write_random(t: Tiers, slots: torch.Tensor, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random K/V for `slots` in every layer; returns what the device pool holds."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(NUM_LAYERS):
        k, v = (torch.randn(len(slots), NUM_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
        t.device_kv.set_kv_buffer(layer, slots, k.to(slots.device), v.to(slots.device))
        dev_k, dev_v = t.device_kv.get_kv_buffer(layer)
        out.append((dev_k[slots].cpu().clone(), dev_v[slots].cpu().clone()))
    return out


def read_device(t: Tiers, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (k[slots].cpu().clone(), v[slots].cpu().clone()) for k, v in map(t.device_kv.get_kv_buffer, range(NUM_LAYERS))
    ]


def alloc_seq(t: Tiers, num_tokens: int) -> torch.Tensor | None:
    """Device slots for a whole-page sequence, evicting the shortfall from the cache first."""
    shortfall = num_tokens - t.allocator.available_size()
    if shortfall > 0:
        t.cache.evict(EvictParams(min(shortfall, t.cache.evictable_size())))
    return t.allocator.alloc(num_tokens)


def insert_seq(t: Tiers, ids: np.ndarray, kv: str = "encoded", seed: int = 0) -> tuple[int, torch.Tensor] | None:
    """Allocate, fill and insert `ids` (whole pages), freeing the duplicates as a caller must.
    Returns (prefix_len, the slots inserted), or None when the device could not take it."""
    slots = alloc_seq(t, len(ids))
    if slots is None:
        return None
    if kv == "encoded":
        write_encoded(t, ids, slots)
    else:
        write_random(t, slots, seed)
    prefix_len = t.cache.insert(ids, slots)
    t.allocator.free(slots[:prefix_len])
    return prefix_len, slots


def node_of(t: Tiers, ids: np.ndarray) -> HiTreeNode:
    """The node whose path ends exactly at ids (match splits it there)."""
    match = t.cache.match_prefix(ids)
    node: HiTreeNode = match.last_host_node if match.host_hit_length else match.last_node
    return node


def check_all(t: Tiers, held_device: list[torch.Tensor] | None = None) -> None:
    """check_integrity of the cache, and exact conservation on both tiers."""
    t.cache.check_integrity()
    held = [t.cache.tree_slots()] + [h.cpu().numpy() for h in held_device or []]
    t.allocator.check_integrity(torch.from_numpy(np.concatenate(held)))
    root = t.cache.root
    device_tokens = sum(n.key_len for n, _, _ in hi_walk(root) if n.value is not None and n is not root)
    assert device_tokens == t.cache.evictable_size() + t.cache.protected_size()
    assert (
        t.allocator.available_size() + device_tokens + sum(len(h) for h in held_device or []) == t.allocator.total_size
    ), (t.allocator.available_size(), device_tokens, t.allocator.total_size)
    assert t.host_allocator.available_size() + len(t.cache.tree_host_slots()) == t.host_allocator.total_size


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)
