"""The read checker the scheduler calls before a forward reads KV (debug mode).

The engine takes one by interface and never knows who implements it (the debugger's
monitor does, in `kvscope.debug`); `None` means no checking, at no cost.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvscope.mem import KVPool


class ReadChecker(Protocol):
    def check_reads(self, rid: str, slots: torch.Tensor) -> None:
        """`rid` is about to read the KV at `slots` (positions [0, len(slots)) of its row).
        Records a violation for every slot that is neither the request's nor the tree's."""
        ...

    def attach_kv_pool(self, kv_pool: KVPool) -> None:
        """Called once the engine has built its KV buffers, before the first step (a
        checker that poisons freed K/V needs them)."""
        ...
