"""Caching a request's KV in a radix tree (semantics note §4.6-4.7), SGLang's bookkeeping.

NOTE: slot ranges of a request's row while it runs:
    [0, cache_protected_len)           owned by the tree (locked through last_node)
    [cache_protected_len, kv_len)      owned by the request
On insert, the tree keeps its own slots where it already had the tokens; the request's
copies of [cache_protected_len, prefix_len) are duplicates and are freed. The sub-page
tail [page_floor(kv_len), kv_len) never enters the tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvscope.cache.base import CacheableRequest, CacheMisuseError, request_row
from kvscope.mem import ReqToTokenPool


class RequestCachingMixin:
    page_size: int
    allocator: Any
    req_to_token_pool: ReqToTokenPool | None

    # provided by the cache class (annotations only, so they shadow nothing in the MRO)
    insert: Callable[..., int]
    inc_lock_ref: Callable[..., int | None]
    dec_lock_ref: Callable[..., None]
    _walk_match: Callable[[bytes], tuple[list[np.ndarray], Any]]
    _to_tensor: Callable[[list[np.ndarray]], torch.Tensor]

    def _row(self, req: CacheableRequest, end: int) -> torch.Tensor:
        return request_row(self.req_to_token_pool, req, end)

    def cache_unfinished_req(self, req: CacheableRequest, chunked: bool = False) -> None:
        ids = req.fill_ids
        kv = self._row(req, len(ids))
        key_len = len(ids) // self.page_size * self.page_size
        prefix_len = self.insert(ids, kv, user=req.user, chunked=chunked, rid=req.rid)
        protected = req.cache_protected_len
        self.allocator.free(kv[protected:prefix_len])
        values, new_last = self._walk_match(np.ascontiguousarray(ids[:key_len], dtype=np.int32).tobytes())
        new_slots = self._to_tensor(values)
        if len(new_slots) != key_len:
            raise CacheMisuseError(f"re-match after insert found {len(new_slots)} of {key_len} tokens")
        assert self.req_to_token_pool is not None and req.req_pool_idx is not None
        self.req_to_token_pool.write(req.req_pool_idx, protected, new_slots[protected:])
        self.dec_lock_ref(req.last_node, req.swa_lock_id, rid=req.rid)
        req.swa_lock_id = self.inc_lock_ref(new_last, rid=req.rid)
        req.last_node = new_last
        req.cache_protected_len = key_len
        req.prefix_indices = torch.cat((new_slots, kv[key_len:]))

    def cache_finished_req(self, req: CacheableRequest, is_insert: bool = True) -> None:
        kv_len = req.kv_committed_len
        kv = self._row(req, kv_len)
        key_len = kv_len // self.page_size * self.page_size
        protected = req.cache_protected_len
        if is_insert:
            freed_end = self.insert(req.fill_ids[:kv_len], kv, user=req.user, rid=req.rid)
        else:
            freed_end = key_len
        self.allocator.free_segments([(kv[protected:freed_end], protected), (kv[key_len:], key_len)])
        self.dec_lock_ref(req.last_node, req.swa_lock_id, rid=req.rid)
        req.swa_lock_id = None
