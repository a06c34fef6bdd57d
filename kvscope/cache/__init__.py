"""Prefix caches: the base contract, radix, chunk and SWA variants, eviction policies."""

from kvscope.cache.base import (
    BasePrefixCache,
    CacheableRequest,
    CacheMisuseError,
    MatchResult,
    NodeRow,
    as_token_ids,
)
from kvscope.cache.chunk import ChunkCache, SWAChunkCache
from kvscope.cache.eviction import POLICIES, EvictionPolicy, get_policy
from kvscope.cache.node import TreeNode
from kvscope.cache.radix import RadixCache
from kvscope.cache.swa_radix import SWARadixCache

__all__ = [
    "POLICIES",
    "BasePrefixCache",
    "CacheMisuseError",
    "CacheableRequest",
    "ChunkCache",
    "EvictionPolicy",
    "MatchResult",
    "NodeRow",
    "RadixCache",
    "SWAChunkCache",
    "SWARadixCache",
    "TreeNode",
    "as_token_ids",
    "get_policy",
]
