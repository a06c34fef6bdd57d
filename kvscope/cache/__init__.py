"""Prefix caches, a package per family, behind the contract in base.py.

    base.py      the contract: BasePrefixCache, SWAPrefixCache, MatchResult, EvictParams, ...
    tree/        the pieces both radix families share: nodes, split, walk, eviction policies
                 and the leaf heap, tree invariants, request caching
    radix/       RadixCache, over one full-attention pool
    swa_radix/   SWARadixCache, over a full and a sliding-window pool (tombstones, window locks)
    chunk.py     ChunkCache and SWAChunkCache: no tree, no reuse
Later families get their own package beside these: scoped/ (a tenant-scoped radix cache)
and hierarchical/ (a host-memory tier under a device tree).
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
    "NodeRow",
    "RadixCache",
    "SWAChunkCache",
    "SWAPrefixCache",
    "SWARadixCache",
    "TreeNode",
    "as_token_ids",
    "get_policy",
]
