"""Prefix caches, a package per family, behind the contract in base.py.

    base.py      the contract: BasePrefixCache, SWAPrefixCache, MatchResult, EvictParams, ...
    tree/        the pieces the radix families share: the node base and operations (split,
                 walk, views), eviction policies and the leaf heap, LockedTree (lock/unlock
                 accounting, evictable leaves, the eviction loop), invariants, request caching
    radix/       RadixCache, over one full-attention pool
    swa_radix/   SWARadixCache, over a full and a sliding-window pool (tombstones, window locks)
    scoped/      ScopedRadixCache, tenant isolation: private and public nodes, promotion by
                 distinct creators in an epoch window, demotion by tombstone (docs/isolation.md)
    hiradix/     HiRadixCache, a device tree over a host-memory tier (write-through/back, load back)
    chunk.py     ChunkCache and SWAChunkCache: no tree, no reuse
The radix families are siblings behind BasePrefixCache, each with its own node class; the
radix, scoped and two-tier caches each hold a LockedTree for what they share.
"""

from kvscope.cache.base import (
    BasePrefixCache,
    CacheableRequest,
    CacheMisuseError,
    EvictParams,
    EvictResult,
    MatchResult,
    NodeRow,
    SWAPrefixCache,
    as_token_ids,
)
from kvscope.cache.chunk import ChunkCache, SWAChunkCache
from kvscope.cache.hiradix import HiRadixCache, HiTreeNode
from kvscope.cache.radix import RadixCache
from kvscope.cache.scoped import MonitorConfig, ScopedNode, ScopedRadixCache
from kvscope.cache.swa_radix import SWANode, SWARadixCache
from kvscope.cache.tree import POLICIES, EvictionPolicy, TreeNode, get_policy

__all__ = [
    "POLICIES",
    "BasePrefixCache",
    "CacheMisuseError",
    "CacheableRequest",
    "ChunkCache",
    "EvictParams",
    "EvictResult",
    "EvictionPolicy",
    "HiRadixCache",
    "HiTreeNode",
    "MatchResult",
    "MonitorConfig",
    "NodeRow",
    "RadixCache",
    "SWAChunkCache",
    "SWANode",
    "SWAPrefixCache",
    "SWARadixCache",
    "ScopedNode",
    "ScopedRadixCache",
    "TreeNode",
    "as_token_ids",
    "get_policy",
]
