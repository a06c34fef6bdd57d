"""Caching a request's KV in a radix tree (docs/memory-semantics.md §4.6-4.7, §5.4), SGLang's
bookkeeping, shared by the radix, SWA radix and two-tier families.

NOTE: slot ranges of a request's row while it runs (p = cache_protected_len, e =
swa_evicted_len, the SWA window frontier, meaningful for SWA trees only):
    [0, p)              owned by the tree (locked through last_node; SWA: window-locked at the tail)
    [p, kv_len)         owned by the request (SWA: [p, e) full KV only, its SWA half already freed)
On insert, the tree keeps its own slots where it already had the tokens; the request's
copies of [p, prefix_len) are duplicates. A family's `insert_unfinished` /
`insert_finished` inserts and returns where the duplicates the caller still has to free
end: a radix tree returns prefix_len (the caller frees them), an SWA tree frees them inside
its insert and returns p. The sub-page tail [page_floor(kv_len), kv_len) never enters the
tree: an unfinished request keeps it, a finished one frees it with its duplicates, in one
free_segments call.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from kvscope.cache.base import CacheableRequest, CacheMisuseError, request_row
from kvscope.cache.tree.node import slots_tensor
from kvscope.mem import ReqToTokenPool, TokenAllocator

NodeT = TypeVar("NodeT")


class RequestTree(Protocol[NodeT]):
    """What request caching needs from a radix family."""

    page_size: int
    device: torch.device
    req_to_token_pool: ReqToTokenPool | None

    @property
    def allocator(self) -> TokenAllocator: ...

    def insert_unfinished(
        self, req: CacheableRequest, token_ids: np.ndarray, slots: torch.Tensor, chunked: bool
    ) -> int: ...

    def insert_finished(self, req: CacheableRequest, token_ids: np.ndarray, slots: torch.Tensor) -> int: ...

    def walk_match(self, key: bytes, user: str | None = None) -> tuple[list[np.ndarray], NodeT]: ...

    def inc_lock_ref(self, node: NodeT, rid: str | None = None) -> int | None: ...

    def dec_lock_ref(self, node: NodeT, lock_id: int | None = None, rid: str | None = None) -> None: ...


def cache_unfinished_req(tree: RequestTree[Any], req: CacheableRequest, chunked: bool) -> None:
    """Insert the computed tokens, free the duplicates, repoint the row at the tree's slots,
    move the lock to the new last node."""
    ids = req.fill_ids
    kv = request_row(tree.req_to_token_pool, req, len(ids))
    key_len = len(ids) // tree.page_size * tree.page_size
    duplicates_end = tree.insert_unfinished(req, ids, kv, chunked)
    protected = req.cache_protected_len
    tree.allocator.free_segments([(kv[protected:duplicates_end], protected)])  # SGLang: free_segment
    values, new_last = tree.walk_match(np.ascontiguousarray(ids[:key_len], dtype=np.int32).tobytes(), req.user)
    new_slots = slots_tensor(values, tree.device)
    if len(new_slots) != key_len:
        raise CacheMisuseError(f"re-match after insert found {len(new_slots)} of {key_len} tokens")
    assert tree.req_to_token_pool is not None and req.req_pool_idx is not None
    tree.req_to_token_pool.write(req.req_pool_idx, protected, new_slots[protected:])
    tree.dec_lock_ref(req.last_node, req.swa_lock_id, rid=req.rid)
    req.swa_lock_id = tree.inc_lock_ref(new_last, rid=req.rid)
    req.last_node = new_last
    req.cache_protected_len = key_len
    req.prefix_indices = torch.cat((new_slots, kv[key_len:]))


def cache_finished_req(tree: RequestTree[Any], req: CacheableRequest, is_insert: bool) -> None:
    """Insert up to kv_committed_len (or not: retract, abort), free the duplicates and the
    sub-page tail (or everything beyond cache_protected_len), release the lock."""
    kv_len = req.kv_committed_len
    kv = request_row(tree.req_to_token_pool, req, kv_len)
    key_len = kv_len // tree.page_size * tree.page_size
    protected = req.cache_protected_len
    duplicates_end = tree.insert_finished(req, req.fill_ids[:kv_len], kv) if is_insert else key_len
    tree.allocator.free_segments([(kv[protected:duplicates_end], protected), (kv[key_len:], key_len)])
    tree.dec_lock_ref(req.last_node, req.swa_lock_id, rid=req.rid)
    req.swa_lock_id = None
