"""CacheController: copies KV rows between the device pool and the host pool and acknowledges
each copy (SGLang's HiCacheController, docs/memory-semantics.md §2.8).

`write(device_slots, op_id)` allocates host slots and copies every layer's K/V rows device ->
host; `load(host_slots, op_id)` allocates device slots and copies host -> device. Each call is
one operation with an opaque `op_id` chosen by the caller; `writing_check()` and
`loading_check()` return the ids of the operations finished since the last call, oldest
first, each exactly once. The controller knows nothing of caches: it never frees the slots
it hands back (the caller owns them, as it owns the slots it passes in).

NOTE: row maps, per layer and for K and V alike:
    write: host_buf[host_slots[i]]     = device_buf[device_slots[i]]
    load:  device_buf[device_slots[i]] = host_buf[host_slots[i]]
The source rows must stay untouched until the operation is acknowledged (the cache keeps
them locked); the destination rows are the caller's once acknowledged (or after wait_all).

NOTE: on CUDA, copies run on a dedicated stream that first waits for the current stream, and
an event recorded after each operation tells its completion. A write gathers the device
rows into pinned staging memory on that stream and scatters them into the host buffers when
its event is seen complete (writing_check or wait_all), so the host rows of a write are
readable only after its acknowledgement. A load gathers the host rows into pinned staging
memory, then copies and scatters them on the stream; a forward that reads the loaded rows
first calls `wait_loads_on_current_stream()` (or waits for the acknowledgement). On the CPU
every copy is synchronous and an operation is complete when the call returns; it is still
acknowledged through the same queues.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvscope.mem.base import INDEX_DTYPE
from kvscope.mem.host_pool import HostKVPool, HostTokenAllocator, as_host_slots
from kvscope.mem.kv_pool import MHATokenToKVPool
from kvscope.mem.token_allocator import BaseTokenAllocator


@dataclass
class _Op:
    """One queued copy. `event` None: the copy is complete; `staged`: host rows of a write
    waiting to be scattered, as (host buffer, staging tensor) pairs."""

    op_id: int
    event: torch.cuda.Event | None = None
    host_slots: torch.Tensor | None = None
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    keep_alive: list[torch.Tensor] = field(default_factory=list)

    def is_done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def finish(self) -> None:
        """Scatter a write's staged rows into the host buffers (after its event completed)."""
        if self.staged:
            assert self.host_slots is not None
            for host_buf, rows in self.staged:
                host_buf.index_copy_(0, self.host_slots, rows)
        self.staged = []
        self.keep_alive = []
        self.event = None


class CacheController:
    """Device <-> host copies of KV rows, acknowledged in operation order (see module doc)."""

    def __init__(
        self,
        device_allocator: BaseTokenAllocator,
        device_kv: MHATokenToKVPool,
        host_allocator: HostTokenAllocator,
        host_kv: HostKVPool,
    ) -> None:
        host_kv.check_matches(device_kv)
        if host_allocator.page_size != device_allocator.page_size:
            raise ValueError(
                f"host page_size {host_allocator.page_size} != device page_size {device_allocator.page_size}"
            )
        if host_allocator.total_size > host_kv.total_size:
            raise ValueError(
                f"host allocator has {host_allocator.total_size} slots, host KV buffers {host_kv.total_size} rows"
            )
        self.device_allocator = device_allocator
        self.device_kv = device_kv
        self.host_allocator = host_allocator
        self.host_kv = host_kv
        self.device = device_kv.device
        self.on_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._writes: deque[_Op] = deque()
        self._loads: deque[_Op] = deque()

    # -- operations ------------------------------------------------------------------------

    def write(self, device_slots: torch.Tensor, op_id: int) -> np.ndarray | None:
        """Copy the rows of `device_slots` to newly allocated host slots and return those
        (int64, in the order of `device_slots`), or None, consuming nothing, when the host
        pool has too few free slots. Acknowledged by writing_check()."""
        host_slots = self.host_allocator.alloc(len(device_slots))
        if host_slots is None:
            return None
        try:
            op = self._copy_to_host(device_slots, torch.from_numpy(host_slots), op_id)
        except BaseException:
            self.host_allocator.free(host_slots)
            raise
        self._writes.append(op)
        return host_slots

    def load(self, host_slots: np.ndarray, op_id: int) -> torch.Tensor | None:
        """Copy the rows of `host_slots` to newly allocated device slots and return those (int64
        on the device, in the order of `host_slots`), or None, consuming nothing, when the device
        allocator has too few free pages (the caller evicts and retries). The number of slots is
        a whole number of pages. Acknowledged by loading_check()."""
        host_idx = torch.from_numpy(as_host_slots(host_slots))
        device_slots = self.device_allocator.alloc(len(host_idx))
        if device_slots is None:
            return None
        try:
            op = self._copy_to_device(host_idx, device_slots, op_id)
        except BaseException:
            self.device_allocator.free(device_slots)
            raise
        self._loads.append(op)
        return device_slots

    def _layer_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device buffer, host buffer) pairs, K then V per layer, in their stored dtype."""
        pairs = []
        for layer in range(self.device_kv.num_layers):
            pairs.append((self.device_kv.k_buffer[layer], self.host_kv.k_buffer[layer]))
            pairs.append((self.device_kv.v_buffer[layer], self.host_kv.v_buffer[layer]))
        return pairs

    def _copy_to_host(self, device_slots: torch.Tensor, host_idx: torch.Tensor, op_id: int) -> _Op:
        dev_idx = device_slots.to(self.device, INDEX_DTYPE)
        if self.stream is None:
            for device_buf, host_buf in self._layer_buffers():
                host_buf.index_copy_(0, host_idx, device_buf.index_select(0, dev_idx))
            return _Op(op_id)
        op = _Op(op_id, torch.cuda.Event(), host_idx)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for device_buf, host_buf in self._layer_buffers():
                rows = device_buf.index_select(0, dev_idx)
                staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                staging.copy_(rows, non_blocking=True)
                op.staged.append((host_buf, staging))
            assert op.event is not None
            op.event.record(self.stream)
        dev_idx.record_stream(self.stream)
        return op

    def _copy_to_device(self, host_idx: torch.Tensor, device_slots: torch.Tensor, op_id: int) -> _Op:
        if self.stream is None:
            for device_buf, host_buf in self._layer_buffers():
                device_buf.index_copy_(0, device_slots, host_buf.index_select(0, host_idx))
            return _Op(op_id)
        self._settle_writes_into(host_idx)
        op = _Op(op_id, torch.cuda.Event())
        stagings = op.keep_alive
        for _, host_buf in self._layer_buffers():
            shape = (len(host_idx), *host_buf.shape[1:])
            staging = torch.empty(shape, dtype=host_buf.dtype, pin_memory=True)
            torch.index_select(host_buf, 0, host_idx, out=staging)
            stagings.append(staging)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for (device_buf, _), staging in zip(self._layer_buffers(), stagings, strict=True):
                device_buf.index_copy_(0, device_slots, staging.to(self.device, non_blocking=True))
            assert op.event is not None
            op.event.record(self.stream)
        device_slots.record_stream(self.stream)
        return op

    def _settle_writes_into(self, host_idx: torch.Tensor) -> None:
        """Finish (without acknowledging) the pending writes whose host rows a load reads, so
        it never reads rows still waiting in staging memory. Callers normally load only
        acknowledged rows; then nothing waits here."""
        pending = [op for op in self._writes if op.staged]
        if not pending:
            return
        wanted = host_idx.numpy()
        for op in pending:
            assert op.host_slots is not None and op.event is not None
            if np.isin(op.host_slots.numpy(), wanted).any():
                op.event.synchronize()
                op.finish()

    # -- acknowledgements -----------------------------------------------------------------

    def writing_check(self) -> list[int]:
        """Ids of the writes finished since the last call, oldest first: the longest finished
        prefix of the queue (copies on one stream finish in order)."""
        return self._drain(self._writes)

    def loading_check(self) -> list[int]:
        """Ids of the loads finished since the last call, oldest first (as writing_check)."""
        return self._drain(self._loads)

    @staticmethod
    def _drain(queue: deque[_Op]) -> list[int]:
        done = []
        while queue and queue[0].is_done():
            op = queue.popleft()
            op.finish()
            done.append(op.op_id)
        return done

    def wait_all(self) -> None:
        """Block until every pending copy is complete; their acknowledgements stay queued for
        the next writing_check / loading_check."""
        for op in (*self._writes, *self._loads):
            if op.event is not None:
                op.event.synchronize()
            op.finish()

    def wait_loads_on_current_stream(self) -> None:
        """Make the current stream wait for every pending load (no host sync; no-op on the CPU)."""
        if self.stream is None:
            return
        current = torch.cuda.current_stream(self.device)
        for op in self._loads:
            if op.event is not None:
                current.wait_event(op.event)

    def pending_writes(self) -> int:
        """Writes not yet acknowledged by writing_check()."""
        return len(self._writes)

    def pending_loads(self) -> int:
        """Loads not yet acknowledged by loading_check()."""
        return len(self._loads)
