"""ChunkCache and SWAChunkCache (docs/memory-semantics.md §6): no reuse, no tree.

A request keeps every slot it computed; chunked prefill snapshots its row as the next
chunk's prefix; on finish it gives back everything beyond cache_protected_len. The SWA
variant also frees the SWA half of tokens that left the window (threshold pre_len - window).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvscope.cache.base import (
    BasePrefixCache,
    CacheableRequest,
    CacheMisuseError,
    EvictParams,
    EvictResult,
    MatchResult,
    NodeRow,
    SWAPrefixCache,
    request_row,
)
from kvscope.mem import ReqToTokenPool, SWATokenToKVPoolAllocator, TokenAllocator, swa_window_frontier
from kvscope.telemetry import NULL_RECORDER, Recorder


class ChunkCache(BasePrefixCache):
    def __init__(
        self,
        allocator: TokenAllocator,
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

    def insert(
        self,
        token_ids: np.ndarray,
        slots: torch.Tensor,
        user: str | None = None,
        chunked: bool = False,
        priority: int = 0,
        rid: str | None = None,
    ) -> int:
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

    def evict(self, params: EvictParams) -> EvictResult:
        if params.num_tokens > 0 or params.swa_num_tokens > 0:
            raise CacheMisuseError(
                f"evict({params.num_tokens}, swa {params.swa_num_tokens}) beyond the evictable size 0 "
                f"(a chunk cache holds no tree)"
            )
        return EvictResult()

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


class SWAChunkCache(ChunkCache, SWAPrefixCache):
    allocator: SWATokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPool

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

    def swa_evictable_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0

    def window_range(self, req: CacheableRequest, pre_len: int) -> tuple[int, int]:
        """Chunk rule: the newest window_len tokens keep their SWA KV."""
        start_len = req.swa_evicted_len
        return start_len, swa_window_frontier(start_len, pre_len, self.window_len, self.page_size)
