"""TokenToKVPoolAllocator: page size 1 (semantics note §2.3).

Slots 1..total_size start free in order; `alloc(n)` hands out the first n; `free` appends,
so reuse is FIFO. Everything else (free groups, need_sort, strict mode) is in the base.
"""

from __future__ import annotations

import torch

from kvscope.mem.base import BaseTokenAllocator


class TokenToKVPoolAllocator(BaseTokenAllocator):
    reuse_order = "fifo"

    def __init__(
        self,
        total_size: int,
        device: str | torch.device | None = None,
        *,
        need_sort: bool = False,
        strict: bool = False,
        name: str = "full",
    ) -> None:
        super().__init__(total_size, 1, device, need_sort=need_sort, strict=strict, name=name)
