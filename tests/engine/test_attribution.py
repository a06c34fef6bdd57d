"""Who an allocation or free is charged to is scoped around the call (mem.charged_to /
charged_to_batch): nothing stale survives an exception, and with recording off the
scheduler hands the allocator nothing to build."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig
from kvscope.engine.engine import Engine
from kvscope.engine.faults import FaultSpec
from kvscope.engine.model import MODEL_PRESETS
from kvscope.engine.request import Req
from kvscope.mem import PoolMisuseError, charged_to, charged_to_batch, make_token_allocator
from kvscope.telemetry import NULL_RECORDER, EventKind, ListRecorder, Recorder


def make_engine(recorder: Recorder, faults: list[FaultSpec] | None = None, cache: str = "radix") -> Engine:
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=512, page_size=1, max_running_requests=4, max_context_len=96),
        cache=CacheConfig(kind=cache),
        device="cpu",
    )  # type: ignore[arg-type]
    return Engine(config, MODEL_PRESETS["tiny"], recorder, faults=faults)


def prompts(num: int) -> list[Req]:
    rng = np.random.default_rng(0)
    return [Req(f"r{i}", rng.integers(3, 500, 12).astype(np.int32), 3) for i in range(num)]


class UnreadBatch(list[Req]):
    """A batch whose requests must not be walked: with recording off, nobody needs their rids."""

    def __iter__(self) -> Iterator[Req]:
        raise AssertionError("the batch was walked with recording off")


def test_a_raising_free_leaves_no_stale_owner() -> None:
    """The engine's own double free (fault injection) meets a strict pool and raises; the
    request it was charged to is not charged for what comes after."""
    recorder = ListRecorder()
    engine = make_engine(recorder, [FaultSpec.parse("double-free:1")], cache="chunk")  # chunk: frees it all
    allocator = engine.memory.allocator
    allocator.set_strict(True)
    with pytest.raises(PoolMisuseError, match="double free"):
        engine.run(prompts(2))
    assert allocator.active_rid is None and allocator.active_batch is None
    fresh = allocator.alloc(1)
    assert fresh is not None
    assert recorder.events[-1].kind is EventKind.ALLOC and recorder.events[-1].rid is None


def test_a_raising_batched_allocation_leaves_no_stale_batch() -> None:
    recorder = ListRecorder()
    allocator = make_token_allocator(64, 1)
    allocator.recorder = recorder
    with pytest.raises(PoolMisuseError), charged_to_batch(allocator, prompts(2), [2, 2]):
        allocator.alloc_extend([0, 0], [2, 2], [-1, -1], 4)  # page size 1 refuses alloc_extend
    assert allocator.active_batch is None
    with charged_to(allocator, "r9"):
        slots = allocator.alloc(2)
    assert slots is not None and [(e.rid, e.num_tokens) for e in recorder.events] == [("r9", 2)]
    assert allocator.active_rid is None


def test_a_batched_allocation_is_split_per_request() -> None:
    recorder = ListRecorder()
    allocator = make_token_allocator(64, 1)
    allocator.recorder = recorder
    with charged_to_batch(allocator, prompts(3), [2, 1, 3]):
        slots = allocator.alloc(6)
    assert slots is not None
    assert [(e.rid, e.slots) for e in recorder.events] == [
        ("r0", slots[:2].tolist()),
        ("r1", slots[2:3].tolist()),
        ("r2", slots[3:].tolist()),
    ]


def test_recording_off_the_scheduler_builds_no_owner_list() -> None:
    """Prefill and decode allocations with the null recorder never walk their batch for owners."""
    engine = make_engine(NULL_RECORDER)
    batch = UnreadBatch(prompts(2))
    assert engine.memory.allocator.recorder.enabled is False
    slots = engine.scheduler._alloc_extend(batch, [0, 0], [5, 7])
    assert isinstance(slots, torch.Tensor) and len(slots) == 12
    slots = engine.scheduler._alloc_decode(batch, [1, 2], [5, 7])
    assert len(slots) == 2
