"""A scoped cache on a real allocator, served one request at a time the way the engine does
(match, lock, allocate the rest, insert, free the duplicates, unlock), with a fake clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvscope.cache import EvictParams, ScopedRadixCache
from kvscope.mem import make_token_allocator


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Scoped:
    def __init__(self, size: int = 2048, page_size: int = 1, **options: Any) -> None:
        self.clock = Clock()
        self.num_requests = 0
        self.allocator = make_token_allocator(size, page_size, "cpu")
        options.setdefault("epoch_s", 10.0)
        self.cache = ScopedRadixCache(self.allocator, page_size, clock=self.clock, strict=True, **options)

    def serve(self, prompt: Sequence[int], user: str | None) -> int:
        """Serve one request; the visible cached tokens (what `cached_tokens` reports)."""
        ids = np.asarray(prompt, dtype=np.int32)
        self.num_requests += 1
        match = self.cache.match_prefix(ids, user, rid=f"r{self.num_requests}")
        self.cache.inc_lock_ref(match.last_node)
        need = len(ids) - match.prefix_len
        if need > self.allocator.available_size():
            self.cache.evict(EvictParams(min(need, self.cache.evictable_size())))
        new = self.allocator.alloc(need)
        assert new is not None
        slots = torch.cat((match.device_indices, new))
        inserted = self.cache.insert(ids, slots, user)
        self.allocator.free(slots[match.prefix_len : inserted])
        self.cache.dec_lock_ref(match.last_node)
        self.cache.check_integrity()
        return match.prefix_len

    def probe(self, prompt: Sequence[int], user: str | None) -> int:
        """The visible match alone, as a request's (no insert)."""
        self.num_requests += 1
        return self.cache.match_prefix(np.asarray(prompt, dtype=np.int32), user, rid=f"r{self.num_requests}").prefix_len

    def tick_epoch(self) -> None:
        """The clock crosses an epoch boundary, and the cache does its boundary work (as the next
        call into it would)."""
        self.clock.now_s += self.cache.epoch_s
        self.cache.advance()

    def conserved(self) -> None:
        """Every slot is free or in the tree (no request holds any between calls)."""
        assert self.allocator.available_size() + self.cache.total_size() == self.allocator.total_size
