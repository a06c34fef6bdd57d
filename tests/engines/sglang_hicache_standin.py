"""Loads SGLang 0.5.18's own HiRadixCache on the CPU, over a synchronous stand-in for its
HiCacheController and host KV pool, for the differential test against kvscope's HiRadixCache.

Only test code uses this (never shipped). hiradix_cache.py, radix_cache.py, evict_policy.py,
base_prefix_cache.py, cache_init_params.py and allocator/{base,token,paged}.py run as SGLang wrote
them, HiRadixCache.__init__ included; the other modules their imports reach are the import-only
stand-ins of tests/engines/sglang518.py plus the ones below. The tree logic (match, split, insert,
hit counts and write-through, locks, device and host eviction, load back, the ack handling of
writing_check / loading_check) is SGLang's, untouched.

NOTE: what SGLang's controller and host pool guarantee on a GPU, and what stands for it here
    controller.write(d, node_id)      host slots from the host pool's alloc (None when short,
                                      consuming nothing); the copy is queued and started at once
                                      (start_writing: one ack per write, node_ids [node_id]).
                                      Here the copy is complete when write returns.
    controller.load(h, node_id)       device slots from the device allocator's alloc (None when
                                      short); the op waits in load_queue until start_loading()
                                      (the scheduler's forward) merges the queue into ONE ack
                                      whose node_ids are the queued ops' ids in order.
    ack.finish_event                  query() tells completion; synchronize() waits for it. Copies
                                      here are synchronous: every queued ack is complete, so
                                      writing_check() / loading_check() release every ack queued
                                      so far, oldest first (on one GPU stream acks complete in
                                      queue order; "all complete at the check" is one of the
                                      schedules a GPU can produce).
    controller.evict_device(d)        the device allocator's free(d) (SGLang's, as written)
    controller.evict_host(h)          the host pool's free(h)
    host pool alloc / free            HostKVCache's slot bookkeeping (pool_host/base.py):
                                      free_slots, frees appended to release_slots, merged onto
                                      free_slots' end only when an alloc needs more than
                                      free_slots holds; alloc takes the first n; size is the
                                      device size * hicache_ratio, plus one page (the real pool
                                      rounds size // page + 1 pages up)
    torch.distributed                 one rank: tp world size 1 and no groups, so _all_reduce
                                      and _pp_sync leave the counts as they are
The data a copy would move is not modelled: no test here reads KV rows.
"""

from __future__ import annotations

import enum
import types
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from tests.engines.sglang518 import _loaded, _module, _package, _stand_ins, import_over

MEMORY = types.SimpleNamespace(hicache_ratio=2.0)  # NOTE: runtime_context.get_memory(): host slots per device slot


class _Done:
    """A finished CUDA event: the copies here are synchronous."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...


class _Ack:
    """HiCacheAck's fields that hiradix_cache.py reads."""

    def __init__(self, node_ids: list[int], num_tokens: int) -> None:
        self.start_event = self.finish_event = _Done()
        self.node_ids = node_ids
        self.num_tokens = num_tokens
        self.timing_enabled = False
        self.num_tokens_by_pool: dict[str, int] | None = None
        self.num_bytes = 0


class StandInController:
    """HiCacheController's write / load / start_loading / evict_device / evict_host and its ack
    queues, with synchronous copies (module NOTE)."""

    def __init__(self, token_to_kv_pool_allocator: Any, mem_pool_host: Any, page_size: int, *args: Any, **kw: Any):
        self.mem_pool_device_allocator = token_to_kv_pool_allocator
        self.mem_pool_host = mem_pool_host
        self.page_size = page_size
        self.write_policy = kw.get("write_policy", "write_through_selective")
        if self.write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ValueError(f"Invalid write policy: {self.write_policy}")
        self.enable_storage = False
        self.load_queue: list[tuple[list[int], int]] = []
        self.ack_write_queue: list[_Ack] = []
        self.ack_load_queue: list[_Ack] = []

    def reset(self) -> None:
        self.load_queue.clear()
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()

    def write(self, device_indices: torch.Tensor, priority: int | None = None, node_id: int = -1) -> Any:
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.ack_write_queue.append(_Ack([node_id], len(device_indices)))
        return host_indices

    def load(self, host_indices: torch.Tensor, priority: int | None = None, node_id: int = -1) -> Any:
        device_indices = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.load_queue.append(([node_id], len(host_indices)))
        return device_indices

    def start_loading(self) -> int:
        if not self.load_queue:
            return -1
        node_ids = [i for ids, _ in self.load_queue for i in ids]
        self.ack_load_queue.append(_Ack(node_ids, sum(n for _, n in self.load_queue)))
        self.load_queue.clear()
        return 0

    def evict_device(self, device_indices: torch.Tensor) -> int:
        self.mem_pool_device_allocator.free(device_indices)
        return len(device_indices)

    def evict_host(self, host_indices: torch.Tensor, backup_only: bool = True) -> int:
        if not backup_only:
            raise ValueError("Other eviction policies are not supported yet.")
        self.mem_pool_host.free(host_indices)
        return len(host_indices)


class StandInHostPool:
    """HostKVCache's slot bookkeeping (module NOTE), without buffers."""

    def __init__(self, device_pool: Any, ratio: float, host_size: int, page_size: int, layout: str, **kw: Any):
        self.page_size, self.layout = page_size, layout
        self.size = (int(device_pool.size * ratio) // page_size + 1) * page_size
        self.size_per_token = 1
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(self.size, dtype=torch.int64)
        self.release_slots: list[torch.Tensor] = []
        self.num_release_slots = 0
        self.slot_used = torch.zeros(self.size, dtype=torch.bool)

    def available_size(self) -> int:
        return len(self.free_slots) + self.num_release_slots

    def alloc(self, need_size: int) -> torch.Tensor | None:
        assert need_size % self.page_size == 0
        if need_size > self.available_size():
            return None
        if need_size > len(self.free_slots) and self.num_release_slots:
            self.free_slots = torch.cat([self.free_slots, *self.release_slots])
            self.release_slots, self.num_release_slots = [], 0
        taken = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        assert not self.slot_used[taken].any(), "double alloc"
        self.slot_used[taken] = True
        return taken

    def free(self, indices: torch.Tensor) -> int:
        if indices.numel() == 0:
            return 0
        assert self.slot_used[indices].all(), "double free"
        self.slot_used[indices] = False
        self.release_slots.append(indices.cpu())
        self.num_release_slots += len(indices)
        return len(indices)

    def slots_in_free_order(self) -> list[int]:
        """The order alloc would hand the free slots out in."""
        return torch.cat([self.free_slots, *self.release_slots]).tolist()


class _MHAPool:
    """memory_pool.MHATokenToKVPool: the device KV pool HiRadixCache.__init__ checks the type of."""


class DevicePool(_MHAPool):
    """What the allocator, the host pool and the controller read of the device KV pool."""

    def __init__(self, size: int) -> None:
        self.size, self.device = size, "cpu"
        self.store_dtype, self.layer_num, self.start_layer, self.end_layer = torch.float16, 1, 0, 1

    def register_layer_transfer_counter(self, counter: Any) -> None: ...


class _Other:
    """A pool or controller type HiRadixCache tests for and never meets here."""


class StorageMedium(enum.Enum):
    GPU = "GPU"
    CPU = "CPU"


def _hicache_stand_ins(src: Path) -> dict[str, types.ModuleType]:
    srt, mem = src / "sglang" / "srt", src / "sglang" / "srt" / "mem_cache"
    fail = lambda *a, **k: (_ for _ in ()).throw(AssertionError("not on this path"))  # noqa: E731
    mods = {
        "sglang.srt.managers": _package("sglang.srt.managers", srt / "managers"),
        "sglang.srt.managers.cache_controller": _module(
            "sglang.srt.managers.cache_controller", HiCacheController=StandInController, PrefetchOperation=_Other
        ),
        "sglang.srt.disaggregation": _package("sglang.srt.disaggregation", srt / "disaggregation"),
        "sglang.srt.disaggregation.kv_events": _module(
            "sglang.srt.disaggregation.kv_events", StorageMedium=StorageMedium
        ),
        "sglang.srt.distributed": _package("sglang.srt.distributed", srt / "distributed"),
        "sglang.srt.distributed.communication_tags": _module(
            "sglang.srt.distributed.communication_tags", P2PTag=types.SimpleNamespace(HIRADIX_PP_SYNC=0)
        ),
        "sglang.srt.mem_cache.hicache_storage": _module(
            "sglang.srt.mem_cache.hicache_storage",
            PoolHitPolicy=_Other,
            PoolName=types.SimpleNamespace(KV=types.SimpleNamespace(value="kv")),
            PoolTransfer=_Other,
            PrefetchTimeoutConfig=lambda **k: types.SimpleNamespace(
                **{"base": 2.0, "per_ki_token": 0.1, "max": 30.0, **k}
            ),
        ),
        "sglang.srt.mem_cache.hybrid_cache": _package("sglang.srt.mem_cache.hybrid_cache", mem / "hybrid_cache"),
        "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller": _module(
            "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
            HybridCacheController=_Other,
            PrefetchOperation=_Other,
        ),
        "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler": _module(
            "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler", attach_hybrid_dsa_pool_to_hiradix_cache=fail
        ),
        "sglang.srt.mem_cache.memory_pool": _module(
            "sglang.srt.mem_cache.memory_pool",
            KVCache=object,
            ReqToTokenPool=object,
            MHATokenToKVPool=_MHAPool,
            DSATokenToKVPool=type("DSATokenToKVPool", (), {}),
            MLATokenToKVPool=type("MLATokenToKVPool", (), {}),
            MiniMaxSparseKVPool=type("MiniMaxSparseKVPool", (), {}),
            HybridLinearKVPool=type("HybridLinearKVPool", (), {}),
        ),
        "sglang.srt.mem_cache.pool_host": _package("sglang.srt.mem_cache.pool_host", mem / "pool_host"),
        "sglang.srt.mem_cache.pool_host.common": _module(
            "sglang.srt.mem_cache.pool_host.common", get_allocator_type=lambda server_args: "default"
        ),
        "sglang.srt.mem_cache.pool_host.mha": _module(
            "sglang.srt.mem_cache.pool_host.mha", get_mha_host_pool_cls=lambda kv_cache: StandInHostPool
        ),
        "sglang.srt.mem_cache.pool_host.mla": _module(
            "sglang.srt.mem_cache.pool_host.mla", MLATokenToKVPoolHost=_Other
        ),
    }
    base = _stand_ins(src)
    mods["sglang.srt.observability.metrics_collector"] = _module(
        "sglang.srt.observability.metrics_collector",
        **vars(base["sglang.srt.observability.metrics_collector"]),
        STAT_LOGGER_ROLE_STORAGE="storage",
        StorageMetricsCollector=_Other,
    )
    mods["sglang.srt.runtime_context"] = _module(
        "sglang.srt.runtime_context",
        get_observability=lambda: None,
        get_memory=lambda: MEMORY,
    )
    mods["sglang.srt.mem_cache.utils"] = _module(
        "sglang.srt.mem_cache.utils", **vars(base["sglang.srt.mem_cache.utils"]), compute_node_hash_values=fail
    )
    return {**base, **mods}


def load_sglang_518_hiradix(src: Path) -> types.SimpleNamespace:
    """SGLang 0.5.18's HiRadixCache and allocators over the stand-ins; `modules` are the modules
    whose `time` stamps the tree's nodes (radix_cache.py and hiradix_cache.py)."""
    m = import_over(
        _hicache_stand_ins(src),
        "allocator",
        "allocator.paged",
        "allocator.token",
        "evict_policy",
        "base_prefix_cache",
        "cache_init_params",
        "radix_cache",
        "hiradix_cache",
    )
    _loaded["paged"], _loaded["evict_policy"] = m["allocator.paged"], m["evict_policy"]
    paged, token, base, params = (
        m["allocator.paged"],
        m["allocator.token"],
        m["base_prefix_cache"],
        m["cache_init_params"],
    )
    radix, hiradix = m["radix_cache"], m["hiradix_cache"]
    return types.SimpleNamespace(
        HiRadixCache=hiradix.HiRadixCache,
        modules=(radix, hiradix),
        TokenToKVPoolAllocator=token.TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=paged.PagedTokenToKVPoolAllocator,
        CacheInitParams=params.CacheInitParams,
        RadixKey=radix.RadixKey,
        MatchPrefixParams=base.MatchPrefixParams,
        InsertParams=base.InsertParams,
        EvictParams=base.EvictParams,
        InitLoadBackParams=base.InitLoadBackParams,
    )


def make_hiradix(
    sgl: types.SimpleNamespace, allocator: Any, page_size: int, write_policy: str, policy: str, host_ratio: float
) -> Any:
    """SGLang's HiRadixCache over `allocator` (built with a DevicePool as its kvcache), its
    __init__ run as written with one rank's torch.distributed; its host pool holds
    host_ratio * the device size, plus a page."""
    MEMORY.hicache_ratio = host_ratio
    params = sgl.CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        eviction_policy=policy,
    )
    server_args = types.SimpleNamespace(
        hicache_size=0,
        hicache_mem_layout="layer_first",
        hicache_storage_backend=None,
        hicache_storage_backend_extra_config=None,
        hicache_storage_prefetch_policy="best_effort",
        hicache_write_policy=write_policy,
        hicache_io_backend="direct",
        served_model_name="kvscope-test",
        extra_metric_labels=None,
    )
    with (
        mock.patch.object(torch.distributed, "get_world_size", lambda group=None: 1),
        mock.patch("atexit.register"),  # NOTE: shutdown detaches a storage backend; there is none
    ):
        return sgl.HiRadixCache(params, server_args)


__all__ = ["DevicePool", "StandInController", "StandInHostPool", "load_sglang_518_hiradix", "make_hiradix"]
