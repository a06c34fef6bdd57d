"""Where each injected fault acts on a request (see faults.py for what they mean)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from kvscope.cache.hiradix import HiTreeNode
from kvscope.engine.faults import FaultInjector, node_target, observe_frees
from kvscope.engine.memory import MemorySystem, SWAMemorySystem
from kvscope.engine.request import Req
from kvscope.mem import charged_to
from kvscope.telemetry import FaultKind


def _own_slots(memory: MemorySystem, req: Req, start: int, end: int) -> torch.Tensor:
    assert req.req_pool_idx is not None
    return memory.req_to_token_pool.read(req.req_pool_idx, start, end)


def maybe_leak_tail(faults: FaultInjector, memory: MemorySystem, req: Req) -> None:
    """The cache is told the KV ends before the last own page, which is never freed."""
    ps, kv_len = memory.page_size, req.kv_committed_len
    keep = kv_len - min(2, kv_len - req.cache_protected_len) if ps == 1 else (kv_len - 1) // ps * ps
    if keep >= kv_len or keep < req.cache_protected_len or not faults.wants(FaultKind.LEAK_TAIL, req.rid):
        return
    faults.injected(FaultKind.LEAK_TAIL, req.rid, _own_slots(memory, req, keep, kv_len).tolist())
    req.kv_committed_len = keep


@contextmanager
def double_free_window(faults: FaultInjector, memory: MemorySystem, req: Req) -> Iterator[None]:
    """Around the release: free again one page (two slots at page size 1) it just freed."""
    if FaultKind.DOUBLE_FREE not in faults.rates:
        yield
        return
    with observe_frees(memory.allocator) as freed:
        yield
    if not freed:
        return
    slots = np.unique(torch.cat(freed).cpu().numpy())
    ps = memory.page_size
    again = slots[:2] if ps == 1 else np.arange(slots[0] // ps * ps, slots[0] // ps * ps + ps)
    if not faults.wants(FaultKind.DOUBLE_FREE, req.rid):
        return
    faults.injected(FaultKind.DOUBLE_FREE, req.rid, again.tolist())
    with charged_to(memory.allocator, req.rid):
        memory.allocator.free(torch.from_numpy(again).to(memory.allocator.device))


def maybe_lock_leak(faults: FaultInjector, memory: MemorySystem, req: Req) -> None:
    """Lock the request's last node again after its release: protected never returns."""
    node = req.last_node
    if node is None or node is memory.cache.root or not faults.wants(FaultKind.LOCK_LEAK, req.rid):
        return
    memory.cache.inc_lock_ref(node, rid=req.rid)
    faults.injected(FaultKind.LOCK_LEAK, req.rid, node.value.tolist(), node_id=node.id)


def maybe_use_after_free(faults: FaultInjector, memory: MemorySystem, req: Req) -> None:
    """Free one page the request still reads (below the page decode continues)."""
    ps = memory.page_size
    start = -(-req.cache_protected_len // ps) * ps
    end = start + ps
    if end > (req.kv_committed_len - 1) // ps * ps or not faults.wants(FaultKind.USE_AFTER_FREE, req.rid):
        return
    slots = _own_slots(memory, req, start, end)
    faults.injected(FaultKind.USE_AFTER_FREE, req.rid, slots.tolist())
    with charged_to(memory.allocator, req.rid):
        memory.allocator.free(slots)


def maybe_swa_window_leak(
    faults: FaultInjector, memory: SWAMemorySystem, req: Req, start_len: int, end_len: int
) -> bool:
    """Drop the SWA slots of positions [start_len, end_len), which left the window, from the
    mapping without freeing them. A WindowHook: True when it took the window move over."""
    if end_len <= start_len or not faults.wants(FaultKind.SWA_WINDOW_LEAK, req.rid):
        return False
    full = _own_slots(memory, req, start_len, end_len)
    mapping = memory.allocator.full_to_swa_index_mapping
    swa = mapping[full]
    live = swa > 0
    mapping[full[live]] = 0
    faults.injected(FaultKind.SWA_WINDOW_LEAK, req.rid, swa[live].tolist())
    req.swa_evicted_len = end_len
    return True


def maybe_host_leak(faults: FaultInjector, node: HiTreeNode, host_slots: np.ndarray) -> bool:
    """A host copy leaves the tree and its host slots are never freed. A HostFreeHook: True
    when it took the free over. Decided once per node (no request owns a host copy)."""
    if not faults.wants(FaultKind.HOST_LEAK, node_target(node.id)):
        return False
    faults.injected(FaultKind.HOST_LEAK, None, host_slots.tolist(), node_id=node.id)
    return True


__all__ = [
    "double_free_window",
    "maybe_host_leak",
    "maybe_leak_tail",
    "maybe_lock_leak",
    "maybe_swa_window_leak",
    "maybe_use_after_free",
]
