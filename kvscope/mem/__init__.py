"""Memory pools and allocators, behaving as SGLang's do (docs/memory-semantics.md §2).

Public surface: the allocator protocol and its implementations (page size 1, paged, SWA),
the request-to-token pool, KV buffers (plain and SWA hybrid), window freeing, the host tier
(its allocator, K/V buffers and the controller copying between tiers), the device helper
and the errors. The contract is in base.py.
"""

from kvscope.mem.base import (
    AllocatorState,
    BatchCharge,
    IntsLike,
    Owner,
    PoolUsage,
    TokenAllocator,
    charged_to,
    charged_to_batch,
)
from kvscope.mem.cache_controller import CacheController
from kvscope.mem.device import available_memory_bytes, cuda_available, resolve_device
from kvscope.mem.errors import IntegrityError, PoolMisuseError
from kvscope.mem.host_pool import HostKVPool, HostTokenAllocator, host_pool_tokens
from kvscope.mem.kv_pool import KVPool, MHATokenToKVPool, SWAKVPool
from kvscope.mem.paged_allocator import PagedTokenToKVPoolAllocator
from kvscope.mem.req_to_token import ReqToTokenPool, RowHolder
from kvscope.mem.swa_allocator import SWATokenToKVPoolAllocator, make_token_allocator
from kvscope.mem.swa_window import free_swa_out_of_window, free_swa_range, swa_window_frontier
from kvscope.mem.token_allocator import BaseTokenAllocator, PageState, TokenToKVPoolAllocator

__all__ = [
    "AllocatorState",
    "BaseTokenAllocator",
    "BatchCharge",
    "CacheController",
    "HostKVPool",
    "HostTokenAllocator",
    "IntegrityError",
    "IntsLike",
    "KVPool",
    "MHATokenToKVPool",
    "Owner",
    "PageState",
    "PagedTokenToKVPoolAllocator",
    "PoolMisuseError",
    "PoolUsage",
    "ReqToTokenPool",
    "RowHolder",
    "SWAKVPool",
    "SWATokenToKVPoolAllocator",
    "TokenAllocator",
    "TokenToKVPoolAllocator",
    "available_memory_bytes",
    "charged_to",
    "charged_to_batch",
    "cuda_available",
    "free_swa_out_of_window",
    "free_swa_range",
    "host_pool_tokens",
    "make_token_allocator",
    "resolve_device",
    "swa_window_frontier",
]
