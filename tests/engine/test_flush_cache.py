"""Engine.flush_cache, SGLang's flush_cache: with nothing running or waiting every cached token
leaves the prefix cache, each leaf recorded as an eviction with reason reset; with a request in
the queue nothing changes."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import MODEL_PRESETS
from kvscope.engine.request import Req
from kvscope.telemetry import EventKind, EvictReason, ListRecorder

KINDS = [("radix", "tiny"), ("scoped-radix", "tiny"), ("hiradix", "tiny"), ("swa-radix", "tiny-swa"), ("chunk", "tiny")]


def engine_of(kind: str, model: str, recorder: ListRecorder) -> Engine:
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=512, max_running_requests=4, max_context_len=128),
        cache=CacheConfig(kind=kind),
        device="cpu",
    )  # type: ignore[arg-type]
    return Engine(config, MODEL_PRESETS[model], recorder)


def requests(tag: str) -> list[Req]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 200, size=24).astype(np.int32)
    return [
        Req(f"{tag}{i}", np.concatenate([shared, rng.integers(3, 200, size=8).astype(np.int32)]), 4) for i in range(3)
    ]


@pytest.mark.parametrize(("kind", "model"), KINDS)
def test_an_idle_flush_empties_the_cache_and_records_each_leaf_as_a_reset(kind: str, model: str) -> None:
    recorder = ListRecorder()
    engine = engine_of(kind, model, recorder)
    engine.run(requests("a"))
    cache, memory = engine.memory.cache, engine.memory
    cached = cache.evictable_size()
    assert cached > 0 or kind == "chunk"
    num_events = len(recorder.events)
    assert engine.flush_cache()
    evicts = [e for e in recorder.events[num_events:] if e.kind == EventKind.EVICT]
    assert cache.evictable_size() == 0 and cache.protected_size() == 0
    assert memory.full_terms().available == memory.full_terms().total
    if kind != "hiradix":
        assert sum(e.num_tokens for e in evicts if e.reason == EvictReason.RESET) == cached, evicts
    else:  # NOTE: a backed-up device leaf goes to-host first; then the host copy leaves, reset
        assert sum(e.num_tokens for e in evicts) == cached
        host = [e for e in recorder.events[num_events:] if e.kind == EventKind.HOST_EVICT]
        assert host and all(e.reason == EvictReason.RESET for e in host)
        assert cache.host_tokens() == 0  # type: ignore[attr-defined]
    engine.check_integrity()
    engine.run(requests("b"))  # the engine serves on from an empty cache
    engine.check_integrity()


def test_a_flush_with_a_request_waiting_changes_nothing() -> None:
    recorder = ListRecorder()
    engine = engine_of("radix", "tiny", recorder)
    engine.run(requests("a"))
    cached = engine.memory.cache.evictable_size()
    engine.submit(requests("b")[0])
    num_events = len(recorder.events)
    assert not engine.flush_cache()
    assert engine.memory.cache.evictable_size() == cached
    assert recorder.events[num_events:] == []


def test_plain_evictions_still_record_capacity() -> None:
    recorder = ListRecorder()
    engine = engine_of("radix", "tiny", recorder)
    engine.run(requests("a"))
    engine.memory.cache.evict_tokens(1)
    with engine.memory.cache.evicting_as(EvictReason.RESET):
        pass
    engine.memory.cache.evict_tokens(1)
    reasons = [e.reason for e in recorder.events if e.kind == EventKind.EVICT]
    assert reasons and set(reasons) == {EvictReason.CAPACITY}
