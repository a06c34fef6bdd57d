"""Device K/V buffers: per layer, K and V of shape [total_size + page_size, kv_heads, head_dim].

NOTE: row r of a layer's buffers holds the K/V of slot r. Rows [0, page_size) are the
padding page: padded tokens may write there, nothing reads it. fp8 KV is stored as uint8
and viewed back as the fp8 dtype on read.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvscope.mem.device import resolve_device
from kvscope.mem.errors import PoolMisuseError

FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


class KVPool(Protocol):
    """What the model and the debugger use of a KV pool, full-only or hybrid alike.

    NOTE: every layer id is global (0 .. num_layers); slots are full-pool slots. A pool
    translates them for the layers that address another pool (SWA layers of a hybrid pool).
    """

    num_layers: int

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_kv_buffer(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, /) -> None: ...

    def translate_loc(self, full_slots: torch.Tensor) -> torch.Tensor:
        """The slots that sliding-window layers address for `full_slots` (a new tensor or the same)."""
        ...

    def buffers_of(self, pool_name: str) -> MHATokenToKVPool:
        """The buffers that hold pool `pool_name`'s slots ("full" or "swa")."""
        ...

    def check_layers(self, num_layers: int, swa_layer_ids: tuple[int, ...]) -> list[MHATokenToKVPool]:
        """Raise ValueError unless the pool has a model's layers; return its buffers."""
        ...

    def bytes_used(self) -> int: ...


class MHATokenToKVPool:
    def __init__(
        self,
        total_size: int,
        page_size: int,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        device: str | torch.device | None = None,
        *,
        v_head_dim: int | None = None,
        name: str = "full",
    ) -> None:
        if min(total_size, page_size, num_kv_heads, head_dim, num_layers) < 1:
            raise ValueError(f"[{name}] KV pool dimensions must all be >= 1")
        self.name = name
        self.total_size = total_size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = torch.uint8 if dtype in FP8_DTYPES else dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.num_layers = num_layers
        self.device = resolve_device(device)
        num_rows = total_size + page_size
        self.k_buffer = [self._buffer(num_rows, self.head_dim) for _ in range(num_layers)]
        self.v_buffer = [self._buffer(num_rows, self.v_head_dim) for _ in range(num_layers)]

    def _buffer(self, num_rows: int, dim: int) -> torch.Tensor:
        return torch.zeros((num_rows, self.num_kv_heads, dim), dtype=self.store_dtype, device=self.device)

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.k_buffer[self._layer(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.v_buffer[self._layer(layer_id)])

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of len(slots) tokens, shapes [len(slots), kv_heads, head_dim]."""
        layer = self._layer(layer_id)
        k, v = k.to(self.dtype), v.to(self.dtype)
        if self.store_dtype != self.dtype:
            k, v = k.view(self.store_dtype), v.view(self.store_dtype)
        self.k_buffer[layer][slots] = k
        self.v_buffer[layer][slots] = v

    def translate_loc(self, full_slots: torch.Tensor) -> torch.Tensor:
        """Every layer of a full-only pool addresses full slots, window layers too."""
        return full_slots

    def buffers_of(self, pool_name: str) -> MHATokenToKVPool:
        return self

    def check_layers(self, num_layers: int, swa_layer_ids: tuple[int, ...]) -> list[MHATokenToKVPool]:
        if self.num_layers != num_layers:
            raise ValueError(f"KV pool has {self.num_layers} layers, the model {num_layers}")
        return [self]

    def _layer(self, layer_id: int) -> int:
        if not 0 <= layer_id < self.num_layers:
            raise PoolMisuseError(self.name, f"layer {layer_id} outside [0, {self.num_layers})")
        return layer_id

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty(0, dtype=self.store_dtype).element_size()
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * itemsize * self.num_layers

    def bytes_used(self) -> int:
        """Bytes the buffers occupy on the device (padding rows included)."""
        return sum(b.numel() * b.element_size() for b in (*self.k_buffer, *self.v_buffer))


class SWAKVPool:
    """Full-attention layers address full slots; SWA layers address translated SWA slots."""

    def __init__(
        self,
        full_pool: MHATokenToKVPool,
        swa_pool: MHATokenToKVPool,
        swa_layer_ids: list[int],
        full_to_swa_index_mapping: torch.Tensor,
    ) -> None:
        num_layers = full_pool.num_layers + swa_pool.num_layers
        if len(swa_layer_ids) != swa_pool.num_layers or not set(swa_layer_ids) <= set(range(num_layers)):
            raise ValueError(f"swa_layer_ids {swa_layer_ids} do not fit {num_layers} layers")
        self.full_kv_pool = full_pool
        self.swa_kv_pool = swa_pool
        self.num_layers = num_layers
        self.full_to_swa_index_mapping = full_to_swa_index_mapping
        full_ids = [i for i in range(num_layers) if i not in set(swa_layer_ids)]
        self.layers_mapping: dict[int, tuple[int, bool]] = {g: (i, False) for i, g in enumerate(full_ids)}
        self.layers_mapping.update({g: (i, True) for i, g in enumerate(swa_layer_ids)})

    def is_swa_layer(self, layer_id: int) -> bool:
        return self.layers_mapping[layer_id][1]

    def translate_loc(self, full_slots: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[full_slots]

    def buffers_of(self, pool_name: str) -> MHATokenToKVPool:
        return self.swa_kv_pool if pool_name == "swa" else self.full_kv_pool

    def check_layers(self, num_layers: int, swa_layer_ids: tuple[int, ...]) -> list[MHATokenToKVPool]:
        found = tuple(sorted(g for g, (_, is_swa) in self.layers_mapping.items() if is_swa))
        if found != swa_layer_ids:
            raise ValueError(f"SWAKVPool has SWA layers {found}, the model {swa_layer_ids}")
        return [self.full_kv_pool, self.swa_kv_pool]

    def _route(self, layer_id: int) -> tuple[MHATokenToKVPool, int, bool]:
        if layer_id not in self.layers_mapping:
            raise PoolMisuseError("swa", f"layer {layer_id} outside [0, {self.num_layers})")
        index, is_swa = self.layers_mapping[layer_id]
        return (self.swa_kv_pool if is_swa else self.full_kv_pool), index, is_swa

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, index, _ = self._route(layer_id)
        return pool.get_kv_buffer(index)

    def set_kv_buffer(self, layer_id: int, full_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pool, index, is_swa = self._route(layer_id)
        slots = self.translate_loc(full_slots) if is_swa else full_slots
        pool.set_kv_buffer(index, slots, k, v)

    def bytes_used(self) -> int:
        return self.full_kv_pool.bytes_used() + self.swa_kv_pool.bytes_used()
