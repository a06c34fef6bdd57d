"""Loads SGLang 0.5.18's own RadixCache, SWARadixCache and token allocators on the CPU, for
differential tests.

The SGLang source is an unpacked wheel (`make sglang-518-src` puts one in
~/.cache/kvscope/sglang-0.5.18; `KVSCOPE_SGLANG_518_SRC` names another). Only these files run
as SGLang wrote them: mem_cache/allocator/{base,token,paged,swa}.py, base_prefix_cache.py,
cache_init_params.py, evict_policy.py, radix_cache.py and swa_radix_cache.py. Everything else
their imports reach (GPU kernels, metrics, KV events, environment flags, the memory pools)
is a small stand-in written here; none of it decides a slot.

NOTE: stand-ins
    environ.envs                    every flag reads False (SGLang's defaults for the SWA options)
    kernels...alloc_extend_kernel   runs paged.py's own alloc_extend_naive (the Triton kernel's reference)
    kernels...alloc_decode_kernel   the same, each request extended by its one new token
    utils.get_num_new_pages         ceil(seq / ps) - ceil(prefix / ps), summed (its definition)
    base_swa_memory_pool.BaseSWAKVPool  holds the mapping the allocator registers; translates by it
    events.KVCacheEventMixin        records nothing
    utils.get_eviction_strategy     the policy's class from evict_policy.py, by name (as utils.py's table)
The modules are loaded with the `sglang` names and then taken out of sys.modules again, so
nothing else in the test process sees a partial `sglang` package.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

SRC_ENV = "KVSCOPE_SGLANG_518_SRC"
MARKER = "sglang/srt/mem_cache/swa_radix_cache.py"


def sglang_518_source() -> Path | None:
    """The unpacked SGLang 0.5.18 wheel, or None when it is not on this machine."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvscope" / "sglang-0.5.18"
    path = Path(os.environ.get(SRC_ENV, cache))
    return path if (path / MARKER).is_file() else None


def needs_source(src: Path | None) -> list[pytest.MarkDecorator]:
    """A differential test module's marks: an engines test, skipped (saying how to get it) without the source."""
    return [
        pytest.mark.engines,
        pytest.mark.skipif(
            src is None,
            reason=f"SGLang 0.5.18 source not unpacked: run `make sglang-518-src` "
            f"or set {SRC_ENV} to an unpacked sglang-0.5.18 wheel",
        ),
    ]


class _Flag:
    def get(self) -> bool:
        return False


class _Envs:
    def __getattr__(self, name: str) -> _Flag:
        return _Flag()


def _num_new_pages(
    seq_lens: torch.Tensor, page_size: int, prefix_lens: torch.Tensor | None = None, decode: bool = False
) -> int:
    if prefix_lens is None or decode:
        return int((seq_lens % page_size == 1).sum())
    after = (seq_lens + page_size - 1) // page_size
    before = (prefix_lens + page_size - 1) // page_size
    return int((after - before).sum())


def _extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    page_size: int,
) -> None:
    """alloc_extend_naive, when the free pages suffice: otherwise the allocator drops the output
    and returns None (the kernel's reads past the free list are the GPU's; naive would raise)."""
    if _num_new_pages(seq_lens, page_size, prefix_lens) > len(free_pages):
        return
    paged = sys.modules.get("sglang.srt.mem_cache.allocator.paged") or _loaded["paged"]
    paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)


class _ExtendKernel:
    """`alloc_extend_kernel[grid](...)` runs paged.py's alloc_extend_naive, its CPU reference."""

    def __getitem__(self, grid: Any) -> Any:
        def launch(
            prefix_lens: torch.Tensor,
            seq_lens: torch.Tensor,
            last_loc: torch.Tensor,
            free_pages: torch.Tensor,
            out_indices: torch.Tensor,
            _bs_pow2: int,
            page_size: int,
        ) -> None:
            _extend(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size)

        return launch


class _DecodeKernel:
    """`alloc_decode_kernel[grid](...)`: one token per request is an extend from seq_len - 1, so it
    runs alloc_extend_naive over those prefixes (the decode kernel has no CPU reference of its own)."""

    def __getitem__(self, grid: Any) -> Any:
        def launch(
            seq_lens: torch.Tensor,
            last_loc: torch.Tensor,
            free_pages: torch.Tensor,
            out_indices: torch.Tensor,
            _bs_pow2: int,
            page_size: int,
        ) -> None:
            _extend(seq_lens - 1, seq_lens, last_loc, free_pages, out_indices, page_size)

        return launch


class _BaseSWAKVPool:
    full_kv_pool = None
    swa_kv_pool = None

    def __init__(self) -> None:
        self.full_to_swa_index_mapping: torch.Tensor | None = None

    def register_mapping(self, mapping: torch.Tensor) -> None:
        self.full_to_swa_index_mapping = mapping

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        assert self.full_to_swa_index_mapping is not None
        return self.full_to_swa_index_mapping[kv_indices]


class _NoEvents:
    def _record_store_event(self, node: Any, medium: Any = None) -> None: ...
    def _record_remove_event(self, node: Any, medium: Any = None) -> None: ...
    def _record_all_cleared_event(self) -> None: ...
    def take_events(self) -> list[Any]:
        return []


_loaded: dict[str, Any] = {}


def strategies(evict_policy: types.ModuleType) -> dict[str, type]:
    """evict_policy.py's strategies by policy name: the class name without "Strategy", lower case
    (LRUStrategy is "lru"), as utils.py's table names them."""
    return {
        name.removesuffix("Strategy").lower(): cls
        for name, cls in vars(evict_policy).items()
        if name.endswith("Strategy") and isinstance(cls, type) and name != "EvictionStrategy"
    }


def _eviction_strategy(policy: str) -> Any:
    return strategies(_loaded["evict_policy"])[policy.lower()]()


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _package(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    return mod


def _stand_ins(src: Path) -> dict[str, types.ModuleType]:
    srt = src / "sglang" / "srt"
    next_pow2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()  # noqa: E731
    no = lambda *args, **kwargs: False  # noqa: E731
    return {
        "sglang": _package("sglang", src / "sglang"),
        "sglang.srt": _package("sglang.srt", srt),
        "sglang.srt.mem_cache": _package("sglang.srt.mem_cache", srt / "mem_cache"),
        "sglang.srt.environ": _module("sglang.srt.environ", envs=_Envs()),
        "sglang.srt.utils": _module(
            "sglang.srt.utils",
            is_npu=no,
            is_hip=no,
            get_bool_env_var=no,
            next_power_of_2=next_pow2,
            get_num_new_pages=_num_new_pages,
        ),
        "sglang.srt.utils.common": _module("sglang.srt.utils.common", get_num_new_pages=_num_new_pages),
        "sglang.kernels": _module("sglang.kernels"),
        "sglang.kernels.ops": _module("sglang.kernels.ops"),
        "sglang.kernels.ops.memory": _module("sglang.kernels.ops.memory"),
        "sglang.kernels.ops.memory.allocator": _module(
            "sglang.kernels.ops.memory.allocator",
            alloc_extend_kernel=_ExtendKernel(),
            alloc_decode_kernel=_DecodeKernel(),
        ),
        "sglang.srt.mem_cache.memory_pool": _module(
            "sglang.srt.mem_cache.memory_pool", KVCache=object, ReqToTokenPool=object
        ),
        "sglang.srt.mem_cache.base_swa_memory_pool": _module(
            "sglang.srt.mem_cache.base_swa_memory_pool", BaseSWAKVPool=_BaseSWAKVPool
        ),
        "sglang.srt.observability": _module("sglang.srt.observability"),
        "sglang.srt.observability.metrics_collector": _module(
            "sglang.srt.observability.metrics_collector",
            STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
            RadixCacheMetricsCollector=object,
            resolve_collector_class=lambda *a, **k: object,
        ),
        "sglang.srt.runtime_context": _module("sglang.srt.runtime_context", get_observability=lambda: None),
        "sglang.srt.mem_cache.events": _module("sglang.srt.mem_cache.events", KVCacheEventMixin=_NoEvents),
        "sglang.srt.mem_cache.utils": _module(
            "sglang.srt.mem_cache.utils",
            get_eviction_strategy=_eviction_strategy,
            get_hash_str=lambda *a, **k: "",
            split_node_hash_value=lambda value, split_len, page_size: (None, None),
        ),
    }


def import_over(stand_ins: dict[str, types.ModuleType], *names: str) -> dict[str, types.ModuleType]:
    """SGLang's modules `names` (short: "allocator.paged" is sglang.srt.mem_cache.allocator.paged),
    imported over `stand_ins`; every sglang module leaves sys.modules again, so each load is
    its own copy and nothing of it is seen by other tests. The package's __init__s only import files."""
    before = set(sys.modules)
    try:
        sys.modules.update(stand_ins)
        return {name: importlib.import_module(f"sglang.srt.mem_cache.{name}") for name in names}
    finally:
        for name in set(sys.modules) - before:
            if name == "sglang" or name.startswith("sglang."):
                del sys.modules[name]


def load_sglang_518(src: Path) -> types.SimpleNamespace:
    """SGLang 0.5.18's classes: the caches, the allocators, the parameter classes; `radix_module`
    is radix_cache.py's module (its `time` is what the trees stamp nodes with)."""
    m = import_over(
        _stand_ins(src),
        "allocator",
        "allocator.paged",
        "allocator.token",
        "allocator.swa",
        "evict_policy",
        "base_prefix_cache",
        "cache_init_params",
        "radix_cache",
        "swa_radix_cache",
    )
    _loaded["paged"], _loaded["evict_policy"] = m["allocator.paged"], m["evict_policy"]
    paged, token, swa_alloc, base = (
        m["allocator.paged"],
        m["allocator.token"],
        m["allocator.swa"],
        m["base_prefix_cache"],
    )
    params, radix, swa_radix = m["cache_init_params"], m["radix_cache"], m["swa_radix_cache"]
    return types.SimpleNamespace(
        RadixCache=radix.RadixCache,
        policies=sorted(strategies(_loaded["evict_policy"])),
        radix_module=radix,
        TokenToKVPoolAllocator=token.TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=paged.PagedTokenToKVPoolAllocator,
        SWARadixCache=swa_radix.SWARadixCache,
        SWATokenToKVPoolAllocator=swa_alloc.SWATokenToKVPoolAllocator,
        KVPool=_BaseSWAKVPool,
        CacheInitParams=params.CacheInitParams,
        RadixKey=radix.RadixKey,
        MatchPrefixParams=base.MatchPrefixParams,
        InsertParams=base.InsertParams,
        EvictParams=base.EvictParams,
        DecLockRefParams=base.DecLockRefParams,
    )
