"""Memory pools and allocators, behaving as SGLang's do (semantics note §2).

Public surface: the request-to-token pool, token allocators (page size 1, paged, SWA),
KV buffers (plain and SWA hybrid), window freeing, the device helper and the errors.
"""

from kvscope.mem.base import AllocatorState, BaseTokenAllocator, PageState, PoolUsage
from kvscope.mem.device import cuda_available, resolve_device
from kvscope.mem.errors import IntegrityError, PoolMisuseError
from kvscope.mem.kv_pool import MHATokenToKVPool, SWAKVPool
from kvscope.mem.paged_allocator import PagedTokenToKVPoolAllocator
from kvscope.mem.req_to_token import ReqToTokenPool, RowHolder
from kvscope.mem.swa_allocator import SWATokenToKVPoolAllocator, make_token_allocator
from kvscope.mem.swa_window import free_swa_out_of_window, swa_window_frontier
from kvscope.mem.token_allocator import TokenToKVPoolAllocator

__all__ = [
    "AllocatorState",
    "BaseTokenAllocator",
    "IntegrityError",
    "MHATokenToKVPool",
    "PageState",
    "PagedTokenToKVPoolAllocator",
    "PoolMisuseError",
    "PoolUsage",
    "ReqToTokenPool",
    "RowHolder",
    "SWAKVPool",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "cuda_available",
    "free_swa_out_of_window",
    "make_token_allocator",
    "resolve_device",
    "swa_window_frontier",
]
