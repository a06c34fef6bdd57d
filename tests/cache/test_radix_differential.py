"""Differential: with no eviction, every match equals a brute-force longest common prefix
over all inserted sequences, truncated to whole pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.cache import RadixCache, SWARadixCache
from kvscope.mem import SWATokenToKVPoolAllocator, make_token_allocator
from tests.cache.helpers import alloc_extend


def brute_force_prefix(query: np.ndarray, inserted: list[np.ndarray], page_size: int) -> int:
    best = 0
    for seq in inserted:
        n = min(len(seq), len(query))
        diff = np.flatnonzero(seq[:n] != query[:n])
        best = max(best, int(diff[0]) if len(diff) else n)
    return best // page_size * page_size


def random_workload(rng: np.random.Generator, num_requests: int) -> list[np.ndarray]:
    """Sequences that branch off each other at random points, over a tiny vocabulary."""
    seqs: list[np.ndarray] = []
    for _ in range(num_requests):
        if seqs and rng.random() < 0.8:
            base = seqs[rng.integers(len(seqs))]
            keep = base[: rng.integers(0, len(base) + 1)]
        else:
            keep = np.empty(0, dtype=np.int32)
        tail = rng.integers(0, 3, size=rng.integers(1, 40)).astype(np.int32)
        seqs.append(np.concatenate((keep, tail)))
    return seqs


@pytest.mark.parametrize("kind", ["radix", "swa-radix"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_equal_brute_force_longest_common_prefix(kind: str, page_size: int, seed: int) -> None:
    """SWA radix without eviction has no tombstones, so the window rule never cuts a match."""
    rng = np.random.default_rng(seed)
    if kind == "radix":
        allocator = make_token_allocator(8192, page_size, "cpu")
        cache = RadixCache(allocator, page_size, strict=True)
    else:
        allocator = SWATokenToKVPoolAllocator(8192, 8192, page_size, "cpu")
        cache = SWARadixCache(allocator, page_size, window_len=8, strict=True)
    inserted: list[np.ndarray] = []
    kv_token = np.full(allocator.total_size + page_size, -1, dtype=np.int64)
    for seq in random_workload(rng, 150):
        match = cache.match_prefix(seq)
        assert match.prefix_len == brute_force_prefix(seq, inserted, page_size)
        hit = match.device_indices.numpy()
        assert (kv_token[hit] == seq[: len(hit)]).all(), "a matched slot holds another token"
        last = int(hit[-1]) if len(hit) else -1
        new = alloc_extend(allocator, len(hit), len(seq), last)
        assert new is not None
        kv_token[new.numpy()] = seq[len(hit) :]
        slots = torch.cat((match.device_indices, new))
        if kind == "radix":
            prefix_len = cache.insert(seq, slots)
        else:
            prefix_len = cache.insert(seq, slots, prev_prefix_len=match.prefix_len)
        assert prefix_len == match.prefix_len
        allocator.free(slots[seq.size // page_size * page_size :])
        inserted.append(seq)
        cache.check_integrity()
    allocator.check_integrity(cache.tree_slots())  # type: ignore[arg-type]
