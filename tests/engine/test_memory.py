"""The memory system's two variants behind one interface: full attention and hybrid
sliding-window models, picked from the model's shape; the window rule at prefill."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvscope.cache import ChunkCache, RadixCache, SWAChunkCache, SWARadixCache
from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.memory import MemorySystem, SWAMemorySystem, WindowHook
from kvscope.engine.model import MODEL_PRESETS
from kvscope.engine.request import Req


def engine(model: str, cache: str, chunk: int | None = None, page_size: int = 1) -> Engine:
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=1024, page_size=page_size, max_running_requests=4, max_context_len=160),
        cache=CacheConfig(kind=cache),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, swa_eviction_interval=1),
        device="cpu",
        strict=True,
    )
    return Engine(config, MODEL_PRESETS[model])


def requests(seed: int, num: int = 6) -> list[Req]:
    rng = np.random.default_rng(seed)
    stem = rng.integers(3, 500, 64).astype(np.int32)
    return [
        Req(
            f"r{i}",
            np.concatenate((stem[: rng.integers(8, 64)], rng.integers(3, 500, 20))).astype(np.int32),
            int(rng.integers(4, 30)),
        )
        for i in range(num)
    ]


@pytest.mark.parametrize(
    ("model", "cache", "variant", "cache_type", "pools"),
    [
        ("tiny", "radix", MemorySystem, RadixCache, ["full", "req"]),
        ("tiny", "chunk", MemorySystem, ChunkCache, ["full", "req"]),
        ("tiny-swa", "swa-radix", SWAMemorySystem, SWARadixCache, ["full", "swa", "req"]),
        ("tiny-swa", "chunk", SWAMemorySystem, SWAChunkCache, ["full", "swa", "req"]),
    ],
)
def test_the_model_shape_picks_the_variant_and_its_pools(
    model: str, cache: str, variant: type, cache_type: type, pools: list[str]
) -> None:
    memory = engine(model, cache).memory
    assert type(memory) is variant and type(memory.cache) is cache_type
    checks = memory.leak_checks(0, [])
    assert [c.pool for c in checks] == pools and all(c.ok for c in checks)
    assert (memory.swa_terms() is None) == (variant is MemorySystem)


def test_full_attention_frees_no_window() -> None:
    memory = engine("tiny", "radix").memory
    called: list[int] = []

    def hook(memory: SWAMemorySystem, req: Req, start_len: int, end_len: int) -> bool:
        called.append(end_len)
        return False

    reqs = requests(0, 2)
    for req in reqs:
        req.kv_committed_len = req.decode_steps = 100
    memory.free_windows_before_extend(reqs, hook)
    memory.free_windows_for_decode(reqs, 1, hook)
    assert called == []


def spy_extend_windows(memory: SWAMemorySystem) -> list[tuple[int, int]]:
    """Record the window range of each request `free_windows_before_extend` is given."""
    seen: list[tuple[int, int]] = []
    original = memory.free_windows_before_extend

    def spy(batch: Sequence[Req], hook: WindowHook | None) -> None:
        seen.extend(memory.cache.window_range(r, r.kv_committed_len) for r in batch if r.kv_committed_len > 0)
        original(batch, hook)

    memory.free_windows_before_extend = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_radix_tree_has_no_window_to_free_before_an_extend(page_size: int) -> None:
    """The NOTE of SWAMemorySystem.free_windows_before_extend: with a tree, the window range of
    a request about to be extended again is empty (a chunk cache's is not)."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for cache in ("swa-radix", "chunk"):
        eng = engine("tiny-swa", cache, chunk=16, page_size=page_size)
        assert isinstance(eng.memory, SWAMemorySystem)
        ranges[cache] = spy_extend_windows(eng.memory)
        stats = eng.run(requests(1))
        eng.check_integrity()
        assert stats.num_finished == 6 and stats.leak_checks_failed == 0
    assert ranges["swa-radix"] and all(start == end for start, end in ranges["swa-radix"])
    assert any(start < end for start, end in ranges["chunk"]), "the chunk cache does free the window per chunk"
