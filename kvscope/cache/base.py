"""The prefix-cache contract (docs/memory-semantics.md §4-§6). Every cache kind implements it.

A prefix cache owns a tree of token keys whose values are KV slots. It knows the pools
(the request-to-token pool and the token allocator) and reports to a telemetry recorder;
it never knows the engine or the SQL store.

Keys are token ids as a 1-D int32 numpy array (`as_token_ids` converts). Values are KV
slots: int64 torch tensors on the allocator's device at the boundary.

Contract:
- `match_prefix(token_ids, user)` -> MatchResult. Does not change node contents, hit
  counts or locks; may split a node (shape only) and refreshes last-access times along the
  path. The match is truncated to whole pages. `device_indices` is a new tensor; its slots
  stay valid only while `last_node` is locked (an unlocked match may be evicted).
- `insert(token_ids, slots, user, chunked)` -> the number of leading tokens that were
  already cached. Slots placed in a new node now belong to the tree; on the overlap the
  tree keeps its own slots, and the caller must free its duplicates beyond what it
  already held (`cache_protected_len`). Keys and slots are truncated to whole pages.
- `cache_unfinished_req(req, chunked)`: after a prefill (chunk), insert the request's
  computed tokens, free its duplicates, repoint its row at the tree's slots, move its lock
  to the new last node. The sub-page tail stays with the request.
- `cache_finished_req(req, is_insert)`: insert prompt + output up to `kv_committed_len`
  (the last sampled token has no KV and is never inserted), free duplicates and the
  sub-page tail, release the request's lock. `is_insert=False` (retract, abort) frees
  everything the request owns beyond `cache_protected_len`.
- `inc_lock_ref(node)` / `dec_lock_ref(node, lock_id)`: lock the path node -> root.
  Tokens move from evictable to protected on each 0 -> 1 transition and back on 1 -> 0.
  The root is always protected. `inc_lock_ref` returns a lock id (SWA window locks) or None.
  `rid` names the request taking or releasing the lock, for the lock / unlock events.
- `evict(EvictParams(num_tokens, swa_num_tokens))` frees at least `num_tokens` full-pool
  tokens (whole leaves may overshoot) from unlocked leaves in policy order, and at least
  `swa_num_tokens` SWA-pool tokens (SWA caches; others have none to free), and returns an
  EvictResult with the tokens freed from each pool. Asking for more than
  `evictable_size()` (or `swa_evictable_size()`) is an error stating the numbers.
  `evict_tokens(num_tokens, swa_num_tokens)` does the same and returns only the full-pool
  tokens freed, as an int (no EvictParams / EvictResult: the engine's path).
- `evictable_size()` / `protected_size()`: tokens in unlocked / locked tree nodes.
- `with cache.evicting_as(EvictReason.RESET):` the evictions inside record that reason where
  they would record `capacity` (a flush of the whole cache records `reset`); restored on exit.
- `check_integrity()` raises IntegrityError with the numbers if any tree invariant breaks.
- `pretty_print()` returns the tree as text; `export_nodes()` the flat node table.
- `root`: the tree's root node (None for a cache with no tree): a request that matched
  nothing holds it as its last node.

Caches over a full pool and a sliding-window pool (SWATokenToKVPoolAllocator) implement
`SWAPrefixCache`, which adds:
- `swa_evictable_size()` / `swa_protected_size()`: SWA tokens the cache could free /
  holds locked (a chunk cache: 0 and 0).
- `window_range(req, pre_len)` -> (start_len, end_len), the family's window rule: with
  `pre_len` tokens, positions [start_len, end_len) of the request leave the window now and
  end_len is its new frontier (start_len <= end_len; equal when nothing moves). Pure.
- `free_window(req, start_len, end_len)` frees the SWA half of those positions (their
  full KV stays with the request) and sets `req.swa_evicted_len = end_len`;
  `free_out_of_window(req, pre_len)` does both steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from kvscope.mem import ReqToTokenPool, SWATokenToKVPoolAllocator, free_swa_range
from kvscope.telemetry import EvictReason, NodeRow  # NOTE: NodeRow: a row of the tree_snapshots table (the one schema)

TOKEN_DTYPE = np.int32


class CacheMisuseError(ValueError):
    """A caller broke the cache contract; the message states the numbers."""


def as_token_ids(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-D int32 array (the array itself when it already is one)."""
    if type(token_ids) is np.ndarray and token_ids.dtype == TOKEN_DTYPE and token_ids.ndim == 1:
        return token_ids
    return np.ascontiguousarray(token_ids, dtype=TOKEN_DTYPE).reshape(-1)


def page_key(ids: np.ndarray, page_size: int) -> bytes:
    """The bytes of the whole pages of `ids` (int32, 4 bytes a token)."""
    key_len = len(ids) - len(ids) % page_size
    return (ids if key_len == len(ids) else ids[:key_len]).tobytes()


def request_row(pool: ReqToTokenPool | None, req: CacheableRequest, end: int) -> torch.Tensor:
    """Slots of positions [0, end) of the request's req_to_token row (a new int64 tensor)."""
    if pool is None:
        raise CacheMisuseError("caching a request needs the cache built with a req_to_token_pool")
    if req.req_pool_idx is None:
        raise CacheMisuseError(f"request {req.rid} holds no req_to_token row")
    return pool.read(req.req_pool_idx, 0, end)


class MatchResult(NamedTuple):
    device_indices: torch.Tensor
    last_node: Any

    @property
    def prefix_len(self) -> int:
        return len(self.device_indices)


# NOTE: slotted dataclasses rather than NamedTuples: built on every evict call, they cost
# about half as much to construct


@dataclass(slots=True)
class EvictParams:
    """How much `evict` must free: full-pool tokens, and SWA-pool tokens (SWA caches)."""

    num_tokens: int = 0
    swa_num_tokens: int = 0


@dataclass(slots=True)
class EvictResult:
    """What `evict` freed, per pool (whole leaves may overshoot the request)."""

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0


class CacheableRequest(Protocol):
    """What a cache reads and writes on a request (the engine's Req implements it).

    NOTE: fill_ids = prompt + outputs so far; positions [0, kv_committed_len) have KV in
    the row `req_pool_idx` of the request-to-token pool; positions [0, cache_protected_len)
    are owned by the tree, the rest by the request.
    """

    rid: str
    user: str | None
    req_pool_idx: int | None
    fill_ids: np.ndarray
    kv_committed_len: int
    cache_protected_len: int
    prefix_indices: torch.Tensor
    last_node: Any
    swa_lock_id: int | None
    swa_evicted_len: int


class BasePrefixCache(ABC):
    page_size: int
    evict_reason: EvictReason = EvictReason.CAPACITY  # NOTE: what a plain eviction records (see evicting_as)

    @contextmanager
    def evicting_as(self, reason: EvictReason) -> Iterator[None]:
        """Evictions in this scope record `reason` where they would record capacity."""
        saved = self.evict_reason
        self.evict_reason = reason
        try:
            yield
        finally:
            self.evict_reason = saved

    @abstractmethod
    def match_prefix(self, token_ids: np.ndarray, user: str | None = None, rid: str | None = None) -> MatchResult: ...

    @abstractmethod
    def insert(
        self,
        token_ids: np.ndarray,
        slots: torch.Tensor,
        user: str | None = None,
        chunked: bool = False,
        priority: int = 0,
        rid: str | None = None,
    ) -> int: ...

    @abstractmethod
    def cache_unfinished_req(self, req: CacheableRequest, chunked: bool = False) -> None: ...

    @abstractmethod
    def cache_finished_req(self, req: CacheableRequest, is_insert: bool = True) -> None: ...

    @abstractmethod
    def inc_lock_ref(self, node: Any, rid: str | None = None) -> int | None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any, lock_id: int | None = None, rid: str | None = None) -> None: ...

    @abstractmethod
    def evict(self, params: EvictParams) -> EvictResult: ...

    def evict_tokens(self, num_tokens: int, swa_num_tokens: int = 0) -> int:
        """`evict` for callers holding ints: same effect, returns the full-pool tokens freed.
        Caches on the hot path override it so that it builds no parameter or result object."""
        return self.evict(EvictParams(num_tokens, swa_num_tokens)).num_tokens_evicted

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    @abstractmethod
    def pretty_print(self) -> str: ...

    @abstractmethod
    def export_nodes(self, preview_tokens: int = 8) -> list[NodeRow]: ...

    @property
    def root(self) -> Any:
        """The tree's root node: a match of nothing ends there, and locking it changes nothing.
        None for a cache with no tree (the chunk caches)."""
        return None

    @property
    def disabled(self) -> bool:
        return False

    def tree_slots(self) -> np.ndarray:
        """Every slot the tree owns (for conservation checks with the allocator)."""
        return np.empty(0, dtype=np.int64)


class SWAPrefixCache(BasePrefixCache):
    """A prefix cache over a full pool and a sliding-window pool (the contract above)."""

    allocator: SWATokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPool | None
    window_len: int

    @abstractmethod
    def swa_evictable_size(self) -> int: ...

    @abstractmethod
    def swa_protected_size(self) -> int: ...

    @abstractmethod
    def window_range(self, req: CacheableRequest, pre_len: int) -> tuple[int, int]: ...

    def free_window(self, req: CacheableRequest, start_len: int, end_len: int) -> None:
        assert self.req_to_token_pool is not None and req.req_pool_idx is not None
        free_swa_range(self.allocator, self.req_to_token_pool, req.req_pool_idx, start_len, end_len)
        req.swa_evicted_len = end_len

    def free_out_of_window(self, req: CacheableRequest, pre_len: int) -> None:
        """Free the SWA half of the request's tokens that left the window."""
        self.free_window(req, *self.window_range(req, pre_len))
