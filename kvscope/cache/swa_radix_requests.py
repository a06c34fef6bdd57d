"""Caching a request's KV in an SWA radix tree (semantics note §5.4).

NOTE: slot ranges of a request's row while it runs (p = cache_protected_len,
e = swa_evicted_len, the window frontier, p <= e):
    [0, p)          owned by the tree (locked through last_node, window-locked at the tail)
    [p, e)          the request's full KV; its SWA half already freed
    [e, kv_len)     the request's full + SWA KV
The insert itself frees the request's duplicates. The sub-page tail never enters the tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvscope.cache.base import CacheableRequest, CacheMisuseError, request_row
from kvscope.mem import ReqToTokenPool


class SWARequestCachingMixin:
    page_size: int
    allocator: Any
    req_to_token_pool: ReqToTokenPool | None

    # provided by the cache class (attributes, so that they shadow nothing in the MRO)
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
        protected = req.cache_protected_len
        if req.swa_evicted_len > protected:
            raise CacheMisuseError(
                f"cache_unfinished_req({req.rid}): SWA frontier {req.swa_evicted_len} beyond the "
                f"protected prefix {protected}; the tree owns the window below the frontier"
            )
        self.insert(ids, kv, user=req.user, chunked=chunked, rid=req.rid, prev_prefix_len=protected)
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
        req.swa_evicted_len = max(req.swa_evicted_len, key_len)
        req.prefix_indices = torch.cat((new_slots, kv[key_len:]))

    def cache_finished_req(self, req: CacheableRequest, is_insert: bool = True) -> None:
        kv_len = req.kv_committed_len
        kv = self._row(req, kv_len)
        key_len = kv_len // self.page_size * self.page_size
        protected = req.cache_protected_len
        if is_insert:
            self.insert(req.fill_ids[:kv_len], kv, user=req.user, rid=req.rid, prev_prefix_len=protected,
                        swa_evicted_len=req.swa_evicted_len)
            self.allocator.free(kv[key_len:])
        else:
            self.allocator.free(kv[protected:])
        self.dec_lock_ref(req.last_node, req.swa_lock_id, rid=req.rid)
        req.swa_lock_id = None
