"""Prefix caches, a package per family, behind the contract in base.py.

    base.py      the contract: BasePrefixCache, SWAPrefixCache, MatchResult, EvictParams, ...
    tree/        the pieces both radix families share: nodes, split, walk, eviction policies
                 and the leaf heap, tree invariants, request caching
    radix/       RadixCache, over one full-attention pool
    swa_radix/   SWARadixCache, over a full and a sliding-window pool (tombstones, window locks)
    scoped/      ScopedRadixCache, tenant isolation: private and public nodes, promotion by
                 distinct creators in an epoch window, demotion by tombstone (docs/isolation.md)
    chunk.py     ChunkCache and SWAChunkCache: no tree, no reuse
A later family gets its own package beside these: hierarchical/ (a host-memory tier under a
device tree).
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
from kvscope.cache.radix import RadixCache
from kvscope.cache.scoped import MonitorConfig, ScopedRadixCache
from kvscope.cache.swa_radix import SWARadixCache
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
    "MatchResult",
    "MonitorConfig",
    "NodeRow",
    "RadixCache",
    "SWAChunkCache",
    "SWAPrefixCache",
    "SWARadixCache",
    "ScopedRadixCache",
    "TreeNode",
    "as_token_ids",
    "get_policy",
]
