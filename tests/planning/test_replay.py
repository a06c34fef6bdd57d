"""Brute-force replays and the request streams they read: the protocol's accounting, the two
capacity conventions, parallel workers agreeing with serial runs, and captures replayed from
their recorded workload config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvscope.app import RunSpec, run
from kvscope.engine.config import EngineConfig
from kvscope.engine.model import MODEL_PRESETS
from kvscope.planning import ReplayConfig, ReplayRequest, load_requests, replay, replay_many, replay_requests
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.workloads import TraceError, TraceRequest, generate, write_trace
from tests.planning.helpers import ceil_pages, random_trace


def request(rid: str, prompt: list[int], output: list[int]) -> ReplayRequest:
    ids = np.array(prompt + output, dtype=np.int32)
    return ReplayRequest(rid, ids[: len(prompt)].copy(), ids)


def test_a_repeated_prompt_hits_whole_pages_only() -> None:
    requests = [request("a", list(range(40)), [100, 101]), request("b", list(range(40)), [102])]
    for page_size, expected in ((1, 40), (16, 32)):
        result = replay(requests, ReplayConfig(1024, page_size))
        assert result.request_hit_tokens.tolist() == [0, expected]
        assert result.num_hit_tokens == expected and result.hit_rate == expected / 80
        # NOTE: b allocates its tail while a's whole pages stay in the tree
        in_b = 42 // page_size * page_size + ceil_pages(41, page_size) - expected
        assert result.peak_usage_tokens == max(ceil_pages(42, page_size), in_b) and result.num_evicted_tokens == 0


def test_slot_convention_skips_a_request_larger_than_the_pool() -> None:
    requests = [
        request("a", list(range(10)), [1]),
        request("big", list(range(50)), [1]),
        request("c", list(range(10)), [2]),
    ]
    result = replay(requests, ReplayConfig(32, 1, convention="slots"))
    assert result.request_hit_tokens.tolist() == [0, -1, 10] and result.num_skipped == 1
    assert result.peak_usage_tokens <= 32
    tree = replay(requests, ReplayConfig(32, 1, convention="tree"))
    assert tree.num_skipped == 0 and tree.peak_usage_tokens == 11 + 41  # a in the tree, big's own 41 in flight


@pytest.mark.parametrize("convention", ["slots", "tree"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_usage_stays_within_the_convention(convention: str, page_size: int) -> None:
    requests = random_trace(3, 60, page_size)
    longest = max(ceil_pages(r.seq_len, page_size) for r in requests)
    for capacity in (2 * longest, 4 * longest):
        result = replay(requests, ReplayConfig(capacity, page_size, "page", convention))
        limit = capacity if convention == "slots" else capacity + longest
        assert 0 < result.peak_usage_tokens <= limit
        assert result.num_evicted_tokens > 0 and result.num_skipped == 0


def test_parallel_workers_agree_with_serial_replays() -> None:
    requests = random_trace(11, 50, 16)
    configs = [ReplayConfig(k, 16, g, "slots") for k in (96, 320) for g in ("page", "leaf")]
    ticks: list[tuple[int, int]] = []
    parallel = replay_many(requests, configs, max_workers=2, on_done=lambda done, total: ticks.append((done, total)))
    for config, result in zip(configs, parallel, strict=True):
        assert result.config == config
        assert np.array_equal(result.request_hit_tokens, replay(requests, config).request_hit_tokens)
    assert ticks[-1] == (4, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 100, "page_size": 16}, "multiple of the page size"),
        ({"capacity": 0}, "holds no page"),
        ({"capacity": 64, "page_size": 3}, "power of two"),
        ({"capacity": 64, "convention": "pool"}, "convention"),
    ],
)
def test_bad_replay_configs_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplayConfig(**kwargs)


def test_an_unknown_eviction_policy_is_rejected_where_the_cache_is_built() -> None:
    """The policy registry lives with the cache (torch), so the torch-free config cannot check it."""
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        replay([request("a", [1, 2], [3])], ReplayConfig(64, eviction_policy="nope"))


def test_sampled_outputs_get_placeholders_that_never_match() -> None:
    trace = [TraceRequest("a", None, np.array([5, 6, 7]), 2), TraceRequest("b", None, np.array([5, 6, 7]), 2)]
    a, b = replay_requests(trace)
    assert a.all_ids.tolist() == [5, 6, 7, -1, -1] and b.all_ids.tolist() == [5, 6, 7, -2, -2]
    assert replay([a, b], ReplayConfig(64)).request_hit_tokens.tolist() == [0, 3]


def test_a_trace_file_and_bad_sources(tmp_path: Path) -> None:
    trace = generate("multi-turn", num_requests=12, seed=4, vocab_size=512)
    write_trace(tmp_path / "t.jsonl", trace)
    loaded = load_requests(tmp_path / "t.jsonl")
    assert [r.all_ids.tolist() for r in loaded] == [r.all_ids.tolist() for r in replay_requests(trace)]
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no requests"):
        load_requests(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="no such file"):
        load_requests(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="--run applies to captures"):
        load_requests(tmp_path / "t.jsonl", run_id=1)


def test_a_capture_replays_the_request_stream_it_recorded(tmp_path: Path) -> None:
    """A real `kvscope run` capture: its run config regenerates the same requests."""
    model = MODEL_PRESETS["tiny"]
    spec = RunSpec(
        engine=EngineConfig(),
        model=model,
        workload="multi-turn",
        num_requests=10,
        seed=3,
        level="summary",
        capture=tmp_path / "run.db",
        workload_options={"num_turns": 3},
    )
    with open(tmp_path / "summary.txt", "w") as out:
        run(spec, out=out)
    expected = replay_requests(
        generate("multi-turn", num_requests=10, seed=3, vocab_size=model.vocab_size, num_turns=3)
    )
    loaded = load_requests(tmp_path / "run.db")
    assert [r.rid for r in loaded] == [r.rid for r in expected]
    assert all(
        np.array_equal(a.all_ids, b.all_ids) and np.array_equal(a.prompt_ids, b.prompt_ids)
        for a, b in zip(loaded, expected, strict=True)
    )
    assert len(load_requests(tmp_path / "run.db", run_id=1)) == 10


def test_capture_runs_that_cannot_be_replayed(tmp_path: Path) -> None:
    trace_path = tmp_path / "t.jsonl"
    write_trace(trace_path, generate("random", num_requests=4, seed=0, vocab_size=512))
    configs: list[dict[str, Any]] = [
        {"workload": {"name": None, "trace": str(trace_path)}, "model": {"vocab_size": 512}},
        {"workload": {"name": None, "trace": str(tmp_path / "gone.jsonl")}},
        {"engine": {}},
    ]
    db = tmp_path / "c.db"
    for config in configs:
        SQLRecorder(db, level="summary", config=config).close()
    assert len(load_requests(db, run_id=1)) == 4
    with pytest.raises(ValueError, match=r"run 2: its trace .*gone.jsonl is not found"):
        load_requests(db, run_id=2)
    with pytest.raises(ValueError, match="names neither a workload nor a trace"):
        load_requests(db)  # the latest run, 3
    with pytest.raises(ValueError, match=r"no run 9 \(runs: 1, 2, 3\)"):
        load_requests(db, run_id=9)
    assert json.loads(json.dumps(configs))  # the configs are plain JSON, as the recorder stores them
