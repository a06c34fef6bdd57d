"""ChunkCache and SWAChunkCache (semantics note §6): no reuse, no tree.

A request keeps every slot it computed; chunked prefill snapshots its row as the next
chunk's prefix; on finish it gives back everything beyond cache_protected_len. The SWA
variant also frees the SWA half of tokens that left the window (threshold pre_len - window).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvscope.cache.base import BasePrefixCache, CacheableRequest, CacheMisuseError, MatchResult, NodeRow, request_row
from kvscope.mem import ReqToTokenPool, SWATokenToKVPoolAllocator, free_swa_out_of_window
from kvscope.telemetry import NULL_RECORDER, Recorder


class ChunkCache(BasePrefixCache):
    def __init__(
        self,
        allocator: Any,
        page_size: int = 1,
        *,
        req_to_token_pool: ReqToTokenPool,
        recorder: Recorder = NULL_RECORDER,
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.req_to_token_pool = req_to_token_pool
        self.recorder = recorder
        self.device = allocator.device

    @property
    def disabled(self) -> bool:
        return True

    def reset(self) -> None:
        """Nothing to forget: a chunk cache holds no tree."""

    def match_prefix(self, token_ids: np.ndarray, user: str | None = None, rid: str | None = None) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64, device=self.device), None)

    def insert(self, token_ids: np.ndarray, slots: torch.Tensor, user: str | None = None,
               chunked: bool = False, priority: int = 0, rid: str | None = None) -> int:
        return 0

    def _row(self, req: CacheableRequest, end: int) -> torch.Tensor:
        return request_row(self.req_to_token_pool, req, end)

    def cache_unfinished_req(self, req: CacheableRequest, chunked: bool = False) -> None:
        req.prefix_indices = self._row(req, len(req.fill_ids))

    def cache_finished_req(self, req: CacheableRequest, is_insert: bool = True) -> None:
        kv = self._row(req, req.kv_committed_len)
        self.allocator.free(kv[req.cache_protected_len :])

    def inc_lock_ref(self, node: Any, rid: str | None = None) -> int | None:
        return None

    def dec_lock_ref(self, node: Any, lock_id: int | None = None, rid: str | None = None) -> None:
        return None

    def evict(self, num_tokens: int) -> int:
        if num_tokens > 0:
            raise CacheMisuseError(f"evict({num_tokens}) beyond the evictable size 0 (a chunk cache holds no tree)")
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def check_integrity(self) -> None:
        """A chunk cache owns no slots; conservation is the allocator's and the requests'."""

    def pretty_print(self) -> str:
        return "(chunk cache: no tree)"

    def export_nodes(self, preview_tokens: int = 8) -> list[NodeRow]:
        return []


class SWAChunkCache(ChunkCache):
    def __init__(
        self,
        allocator: SWATokenToKVPoolAllocator,
        page_size: int = 1,
        *,
        req_to_token_pool: ReqToTokenPool,
        window_len: int,
        recorder: Recorder = NULL_RECORDER,
    ) -> None:
        if window_len < 1:
            raise CacheMisuseError(f"window_len must be >= 1, got {window_len}")
        super().__init__(allocator, page_size, req_to_token_pool=req_to_token_pool, recorder=recorder)
        self.window_len = window_len

    def free_out_of_window(self, req: CacheableRequest, pre_len: int) -> None:
        """Free the SWA half of the request's tokens that left the window."""
        assert req.req_pool_idx is not None
        req.swa_evicted_len = free_swa_out_of_window(
            self.allocator, self.req_to_token_pool, req.req_pool_idx, req.swa_evicted_len, pre_len,
            self.window_len, for_radix=False,
        )
