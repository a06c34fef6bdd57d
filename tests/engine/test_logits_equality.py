"""The memory system is proven by the model's numbers: with the prefix cache on, every
logits row the engine computes (chunked prefill, decode, after retraction and resumption)
equals the dense forward without any pool, and the run with caching disabled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import MODEL_PRESETS
from kvscope.engine.request import Req

Key = tuple[str, int]  # (rid, position whose next token the logits predict)


def make_requests(seed: int, num: int = 10, out_range: tuple[int, int] = (1, 24)) -> list[Req]:
    """Overlapping prompts with forced outputs, so every run sees the same sequences."""
    rng = np.random.default_rng(seed)
    stem = rng.integers(3, 500, 48).astype(np.int32)
    reqs = []
    for i in range(num):
        shared = stem[: rng.integers(8, 48)]  # NOTE: draw order matters: it fixes the workload
        prompt = np.concatenate((shared, rng.integers(3, 500, rng.integers(2, 30)))).astype(np.int32)
        out_len = int(rng.integers(*out_range))
        reqs.append(Req(f"r{i}", prompt, out_len, forced_output_ids=rng.integers(3, 500, out_len).astype(np.int32)))
    return reqs


def run(
    model: str,
    cache: str,
    page_size: int,
    kv_tokens: int,
    chunk: int | None,
    seed: int,
    out_range: tuple[int, int] = (1, 24),
) -> tuple[dict[Key, torch.Tensor], Engine]:
    seen: dict[Key, torch.Tensor] = {}

    def keep(req: Req, position: int, logits: torch.Tensor) -> None:
        seen[(req.rid, position)] = logits.detach().clone()

    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=kv_tokens, page_size=page_size, max_running_requests=8, max_context_len=160),
        cache=CacheConfig(kind=cache),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, swa_eviction_interval=4),
        device="cpu",
        strict=True,
    )
    engine = Engine(config, MODEL_PRESETS[model], on_logits=keep)
    stats = engine.run(make_requests(seed, out_range=out_range))
    engine.check_integrity()
    assert stats.num_finished == 10 and stats.leak_checks_failed == 0
    return seen, engine


def dense_logits(engine: Engine, seed: int, out_range: tuple[int, int] = (1, 24)) -> dict[Key, torch.Tensor]:
    out = {}
    for req in make_requests(seed, out_range=out_range):
        ids = np.concatenate((req.prompt_ids, req.forced_output_ids[:-1]))  # type: ignore[index]
        logits = engine.model.dense_forward(torch.from_numpy(ids.astype(np.int64)))
        for position in range(len(ids)):
            out[(req.rid, position)] = logits[position]
    return out


def assert_same(got: dict[Key, torch.Tensor], want: dict[Key, torch.Tensor]) -> None:
    assert got, "the engine reported no logits"
    assert not [k for k in got if k not in want], "logits at positions the dense forward never computes"
    for key, logits in got.items():
        torch.testing.assert_close(logits, want[key], atol=2e-5, rtol=1e-4, msg=f"logits differ at {key}")
    finals = {(r, p) for (r, p) in want if (r, p + 1) not in want}
    assert finals <= set(got), "a request's last prediction is missing"


CASES = [
    ("tiny", "radix", 1, 4096, None),
    ("tiny", "radix", 4, 4096, 16),
    ("tiny", "radix", 1, 320, 16),  # tight: evicts and retracts
    ("tiny-swa", "swa-radix", 1, 4096, 16),
    ("tiny-swa", "swa-radix", 4, 360, 16),
    ("tiny-swa", "chunk", 1, 4096, 8),
]


@pytest.mark.parametrize(("model", "cache", "page_size", "kv_tokens", "chunk"), CASES)
def test_cached_logits_equal_dense_and_uncached(
    model: str, cache: str, page_size: int, kv_tokens: int, chunk: int | None
) -> None:
    seed = 7
    cached, engine = run(model, cache, page_size, kv_tokens, chunk, seed)
    uncached, _ = run(model, "none" if model == "tiny" else "chunk", page_size, 4096, chunk, seed)
    dense = dense_logits(engine, seed)
    assert_same(cached, dense)
    assert_same(uncached, dense)
    if cache != "chunk":
        assert engine.stats.cached_tokens > 0, "no prefix was ever reused; the test would prove little"


PRESSURE = [  # (model, cache, page size, chunk, whether this pool must retract)
    ("tiny", "radix", 1, 16, True),
    ("tiny", "radix", 1, None, True),  # unchunked: several requests per prefill batch insert duplicates
    ("tiny", "radix", 4, None, False),
    ("tiny-swa", "swa-radix", 1, 16, True),
    ("tiny-swa", "swa-radix", 1, None, False),
]


@pytest.mark.parametrize(("model", "cache", "page_size", "chunk", "retracts"), PRESSURE)
def test_under_pressure_every_logits_row_still_matches_dense(
    model: str, cache: str, page_size: int, chunk: int | None, retracts: bool
) -> None:
    """Long outputs in a small pool: freed duplicates are reused at once, the tree evicts, and
    decode runs out of memory and retracts; every logits row must still be the dense one."""
    cached, engine = run(model, cache, page_size, 256 if model == "tiny" else 300, chunk, 7, out_range=(24, 48))
    assert engine.stats.evicted_tokens > 0, "the pool never evicted; the test would prove little"
    if retracts:
        assert engine.stats.num_retractions > 0, "the tight pool never retracted; tighten it"
    assert_same(cached, dense_logits(engine, 7, out_range=(24, 48)))
