"""Shared pieces for cache tests: a request stand-in and slot allocation in either mode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Req:
    """Implements kvscope.cache.CacheableRequest for tests."""

    rid: str
    fill_ids: np.ndarray
    user: str | None = None
    req_pool_idx: int | None = None
    kv_committed_len: int = 0
    cache_protected_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    swa_lock_id: int | None = None
    swa_evicted_len: int = 0


def alloc_extend(allocator: Any, prefix_len: int, seq_len: int, last_loc: int) -> torch.Tensor | None:
    """Slots for positions [prefix_len, seq_len) whatever the allocator's page size."""
    if allocator.page_size == 1:
        return allocator.alloc(seq_len - prefix_len)
    return allocator.alloc_extend([prefix_len], [seq_len], [last_loc], seq_len - prefix_len)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)
