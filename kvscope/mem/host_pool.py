"""The host memory tier (docs/memory-semantics.md §2.8): its size, its slot allocator and its K/V buffers.

The host pool holds copies of device KV that the hierarchical cache keeps beyond device
memory. It is sized from the device pool (`host_pool_tokens`), its slots are handed out by
`HostTokenAllocator` and its rows live in `HostKVPool`, pinned when CUDA is present so
copies to and from the device can run asynchronously.

NOTE: slot map of a host pool of `total_size` tokens: slots [0, total_size), no padding
slot (nothing writes dummy tokens on the host). Row r of a layer's host K/V buffers holds
slot r. total_size is a whole number of pages.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kvscope.mem.base import PoolUsage
from kvscope.mem.errors import IntegrityError, PoolMisuseError
from kvscope.mem.kv_pool import FP8_DTYPES, MHATokenToKVPool
from kvscope.telemetry import NULL_RECORDER, EventKind, PoolName, Recorder

HOST_INDEX_DTYPE = np.int64


def host_pool_tokens(
    device_tokens: int, page_size: int, *, ratio: float | None = 2.0, tokens: int | None = None
) -> int:
    """Host pool size in tokens, as SGLang sizes it.

    `tokens` when given (`--host-tokens`), else `device_tokens * ratio` (`--host-ratio`);
    then one page more than the whole pages that fit: `(size // page_size + 1) * page_size`,
    so an already aligned size still gains a page.
    """
    if page_size < 1:
        raise ValueError(f"host pool: page_size must be >= 1, got {page_size}")
    if tokens is not None:
        if not math.isfinite(tokens) or tokens < page_size:
            raise ValueError(f"host pool: tokens must be a finite number >= page_size ({page_size}), got {tokens}")
        size_tokens = int(tokens)
    else:
        if ratio is None:
            raise ValueError("host pool: give a ratio of the device pool or a number of tokens")
        if not math.isfinite(ratio) or ratio <= 0:
            raise ValueError(f"host pool: ratio must be a finite number > 0, got {ratio}")
        if device_tokens < 1:
            raise ValueError(f"host pool: device_tokens must be >= 1, got {device_tokens}")
        size_tokens = int(device_tokens * ratio)
    return (size_tokens // page_size + 1) * page_size


def as_host_slots(slots: Any) -> np.ndarray:
    """Slots as a flat int64 host array (numpy arrays, tensors on any device, lists)."""
    if isinstance(slots, torch.Tensor):
        slots = slots.detach().cpu().numpy()
    return np.asarray(slots, dtype=HOST_INDEX_DTYPE).reshape(-1)


class HostTokenAllocator:
    """Token-granular allocator of host slots [0, total_size).

    NOTE: free slots are `free_slots` followed by `release_slots`. `alloc(n)` takes the
    first n of `free_slots`, merging `release_slots` onto its end only when `free_slots`
    alone is too short; `free` appends to `release_slots`. Reuse is therefore FIFO, and
    the merge changes no order, only where the slots wait. `num_tokens` of an allocation
    is a multiple of page_size, so slots handed out from a fresh pool are whole pages;
    frees are token-granular.

    With a recorder, every alloc and free is an event of pool host (no request: the cache's
    write event says which node the slots went to).

    Strict mode keeps `slot_used` (one bool per slot) and rejects double alloc and double
    free where they happen; check_integrity() finds either afterwards in any mode.
    """

    def __init__(self, size_tokens: int, page_size: int, *, strict: bool = False, name: str = "host") -> None:
        if page_size < 1:
            raise ValueError(f"[{name}] page_size must be >= 1, got {page_size}")
        if size_tokens < page_size or size_tokens % page_size:
            raise ValueError(
                f"[{name}] size_tokens must be a positive multiple of page_size ({page_size}), got {size_tokens}"
            )
        self.name = name
        self.page_size = page_size
        self.total_size = size_tokens
        self._strict = strict
        self.slot_used: np.ndarray | None = None
        self.recorder: Recorder = NULL_RECORDER
        self.clear()

    # -- state -------------------------------------------------------------------------

    def clear(self) -> None:
        self.free_slots = np.arange(self.total_size, dtype=HOST_INDEX_DTYPE)
        self.release_slots = np.empty(0, dtype=HOST_INDEX_DTYPE)
        if self._strict:
            self.slot_used = np.zeros(self.total_size, dtype=bool)

    @property
    def strict(self) -> bool:
        return self._strict

    def set_strict(self, strict: bool) -> None:
        """Turn strict tracking on or off. Turned on mid-run, every slot not on a free list is used."""
        if strict and not self._strict:
            used = np.ones(self.total_size, dtype=bool)
            free = self.free_slot_ids()
            used[free[(free >= 0) & (free < self.total_size)]] = False
            self.slot_used = used
        elif not strict:
            self.slot_used = None
        self._strict = strict

    def available_size(self) -> int:
        return len(self.free_slots) + len(self.release_slots)

    def usage(self) -> PoolUsage:
        return PoolUsage(self.total_size, self.available_size())

    def free_slot_ids(self) -> np.ndarray:
        """Every free slot, free list then release list (a new array)."""
        return np.concatenate((self.free_slots, self.release_slots))

    def merge_release(self) -> None:
        if len(self.release_slots):
            self.free_slots = self.free_slot_ids()
            self.release_slots = np.empty(0, dtype=HOST_INDEX_DTYPE)

    # -- alloc / free ------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> np.ndarray | None:
        """`num_tokens` slots (a multiple of page_size) in free-list order, or None, consuming
        nothing, when fewer are free. The slots are the caller's until passed to `free`."""
        if num_tokens < 0 or num_tokens % self.page_size:
            raise PoolMisuseError(
                self.name, f"alloc of {num_tokens} tokens is not a whole number of pages (page_size {self.page_size})"
            )
        if num_tokens > len(self.free_slots):
            if num_tokens > self.available_size():
                return None
            self.merge_release()
        slots = self.free_slots[:num_tokens]
        if self.slot_used is not None:
            self._check_alloc(slots)
            self.slot_used[slots] = True
        self.free_slots = self.free_slots[num_tokens:]
        slots = slots.copy()
        if self.recorder.enabled and num_tokens:
            self.recorder.record(EventKind.ALLOC, pool=PoolName.HOST, num_tokens=num_tokens, slots=slots)
        return slots

    def free(self, slots: Any) -> None:
        """Return `slots` (np.ndarray, or anything as_host_slots takes); an empty input is a no-op."""
        slots_np = as_host_slots(slots)
        if len(slots_np) == 0:
            return
        if self.slot_used is not None:
            self._check_free(slots_np)
            self.slot_used[slots_np] = False
        self.release_slots = np.concatenate((self.release_slots, slots_np))
        if self.recorder.enabled:
            self.recorder.record(EventKind.FREE, pool=PoolName.HOST, num_tokens=len(slots_np), slots=slots_np)

    # -- strict mode --------------------------------------------------------------------

    def _check_alloc(self, slots: np.ndarray) -> None:
        assert self.slot_used is not None
        uniq, counts = np.unique(slots, return_counts=True)
        twice = uniq[counts > 1]
        if len(twice):
            raise PoolMisuseError(self.name, "double alloc: the free list hands out a slot twice", twice.tolist())
        used = slots[self.slot_used[slots]]
        if len(used):
            raise PoolMisuseError(self.name, "double alloc: slots already in use", used.tolist())

    def _check_free(self, slots: np.ndarray) -> None:
        assert self.slot_used is not None
        outside = slots[(slots < 0) | (slots >= self.total_size)]
        if len(outside):
            raise PoolMisuseError(self.name, f"freeing slots outside [0, {self.total_size})", outside.tolist())
        uniq, counts = np.unique(slots, return_counts=True)
        twice = uniq[counts > 1]
        if len(twice):
            raise PoolMisuseError(self.name, "double free within one call", twice.tolist())
        already = slots[~self.slot_used[slots]]
        if len(already):
            raise PoolMisuseError(self.name, "double free: slots already free", already.tolist())

    # -- integrity ----------------------------------------------------------------------

    def check_integrity(self, held: np.ndarray | None = None) -> None:
        """Raise IntegrityError, printing the numbers, if a conservation rule is broken.

        `held`: every slot held outside the allocator. When given, free + held covers
        [0, total_size) exactly once.
        """
        free = self.free_slot_ids()
        bad = free[(free < 0) | (free >= self.total_size)]
        if len(bad):
            raise IntegrityError(f"[{self.name}] free slots outside [0, {self.total_size}): {bad[:16].tolist()}")
        uniq, counts = np.unique(free, return_counts=True)
        if (counts > 1).any():
            raise IntegrityError(f"[{self.name}] slots free twice: {uniq[counts > 1][:16].tolist()}")
        if self.slot_used is not None:
            self._check_slot_used(free)
        if held is not None:
            self._check_held(free, as_host_slots(held))

    def _check_slot_used(self, free: np.ndarray) -> None:
        assert self.slot_used is not None
        marked = free[self.slot_used[free]]
        if len(marked):
            raise IntegrityError(f"[{self.name}] free slots marked used: {marked[:16].tolist()}")
        num_used, expected = int(self.slot_used.sum()), self.total_size - len(free)
        if num_used != expected:
            raise IntegrityError(f"[{self.name}] slot_used counts {num_used} slots in use, free lists imply {expected}")

    def _check_held(self, free: np.ndarray, held: np.ndarray) -> None:
        uniq, counts = np.unique(held, return_counts=True)
        if (counts > 1).any():
            raise IntegrityError(f"[{self.name}] slots held twice: {uniq[counts > 1][:16].tolist()}")
        both = np.intersect1d(free, held)
        if len(both):
            raise IntegrityError(f"[{self.name}] slots both free and held: {both[:16].tolist()}")
        if len(free) + len(held) != self.total_size:
            leaked = np.setdiff1d(np.arange(self.total_size), np.concatenate((free, held)))
            raise IntegrityError(
                f"[{self.name}] conservation broken: free {len(free)} + held {len(held)} != {self.total_size} "
                f"slots; leaked slots {leaked[:16].tolist()}"
            )


class HostKVPool:
    """Host K/V buffers: per layer, K and V of shape [total_size, kv_heads, head_dim] on the CPU.

    NOTE: row r holds host slot r; no padding rows. fp8 KV is stored as uint8, as on the
    device, so copies between the tiers move the stored bytes unchanged. Pinned
    (page-locked) when `pin_memory` is True, or when it is None and CUDA is available.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        size_tokens: int,
        *,
        pin_memory: bool | None = None,
        v_head_dim: int | None = None,
        name: str = "host",
    ) -> None:
        if min(num_layers, kv_heads, head_dim, size_tokens) < 1:
            raise ValueError(f"[{name}] host KV pool dimensions must all be >= 1")
        pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        if pinned and not torch.cuda.is_available():
            raise ValueError(f"[{name}] pin_memory=True needs CUDA, and none is available")
        self.name = name
        self.num_layers = num_layers
        self.num_kv_heads = kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.store_dtype = torch.uint8 if dtype in FP8_DTYPES else dtype
        self.total_size = size_tokens
        self.pinned = pinned
        self.k_buffer = [self._buffer(self.head_dim) for _ in range(num_layers)]
        self.v_buffer = [self._buffer(self.v_head_dim) for _ in range(num_layers)]

    @classmethod
    def like(cls, device_kv: MHATokenToKVPool, size_tokens: int, *, pin_memory: bool | None = None) -> HostKVPool:
        """A host pool with `device_kv`'s layers, heads, dims and dtype."""
        return cls(
            device_kv.num_layers,
            device_kv.num_kv_heads,
            device_kv.head_dim,
            device_kv.dtype,
            size_tokens,
            pin_memory=pin_memory,
            v_head_dim=device_kv.v_head_dim,
        )

    def _buffer(self, dim: int) -> torch.Tensor:
        shape = (self.total_size, self.num_kv_heads, dim)
        return torch.zeros(shape, dtype=self.store_dtype, device="cpu", pin_memory=self.pinned)

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer_id < self.num_layers:
            raise PoolMisuseError(self.name, f"layer {layer_id} outside [0, {self.num_layers})")
        return self._view(self.k_buffer[layer_id]), self._view(self.v_buffer[layer_id])

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty(0, dtype=self.store_dtype).element_size()
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * itemsize * self.num_layers

    def bytes_used(self) -> int:
        """Bytes the host buffers occupy."""
        return sum(b.numel() * b.element_size() for b in (*self.k_buffer, *self.v_buffer))

    def check_matches(self, device_kv: MHATokenToKVPool) -> None:
        """Raise ValueError unless rows of `device_kv` and of this pool have the same shape and dtype."""
        mine = (self.num_layers, self.num_kv_heads, self.head_dim, self.v_head_dim, self.store_dtype)
        theirs = (
            device_kv.num_layers,
            device_kv.num_kv_heads,
            device_kv.head_dim,
            device_kv.v_head_dim,
            device_kv.store_dtype,
        )
        if mine != theirs:
            raise ValueError(
                f"[{self.name}] host pool (layers, heads, head_dim, v_head_dim, dtype) {mine} != device pool {theirs}"
            )
