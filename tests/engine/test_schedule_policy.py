"""The waiting queue's order (docs/memory-semantics.md §9.2): fcfs admits in arrival order;
lpm admits the longest cached prefix first (ties in arrival order), keeps arrival order above
128 waiting requests and under a chunk cache; a bad policy name is one line.

NOTE: the engines here admit one request per step (max_running_requests=1, max_new_tokens=1,
so each request finishes in its prefill), so the admission step of each request is its rank.
A warm-up request caches PREFIX; "hot" requests extend it, "cold" ones start with a token no
other request starts with, so they match nothing."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.app import main
from kvscope.app.cli import build_parser
from kvscope.app.runner import engine_from_args
from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import MODEL_PRESETS
from kvscope.engine.request import Req
from kvscope.engine.scheduler import LPM_MAX_WAITING

RNG = np.random.default_rng(15)
PREFIX = np.concatenate(([3], RNG.integers(4, 100, 47))).astype(np.int32)  # 48 tokens, starts with 3


def engine(policy: str, cache: str = "radix", max_running: int = 1) -> Engine:
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=4096, max_running_requests=max_running, max_context_len=128),
        cache=CacheConfig(kind=cache),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(chunked_prefill_size=None, schedule_policy=policy),  # type: ignore[arg-type]
        device="cpu",
        strict=True,
    )
    return Engine(config, MODEL_PRESETS["tiny"])


def hot(rid: str, shared_len: int) -> Req:
    """A request whose first `shared_len` tokens are PREFIX's."""
    return Req(rid, np.concatenate((PREFIX[:shared_len], RNG.integers(100, 500, 12))).astype(np.int32), 1)


def cold(rid: str, first_token: int) -> Req:
    return Req(rid, np.concatenate(([first_token], RNG.integers(100, 500, 20))).astype(np.int32), 1)


def drain(eng: Engine) -> None:
    """Step until idle, run the idle leak check, and check every pool and the cache."""
    while not eng.scheduler.is_idle():
        eng.step()
    eng.step()
    assert eng.stats.leak_checks_failed == 0 and eng.stats.leak_checks_passed >= 1
    eng.check_integrity()


def admission_order(policy: str, reqs: list[Req], cache: str = "radix") -> list[str]:
    """Warm PREFIX up, submit `reqs` at once, and return their rids by admission step."""
    eng = engine(policy, cache)
    eng.submit(Req("warm", PREFIX.copy(), 2))
    drain(eng)
    for req in reqs:
        eng.submit(req)
    drain(eng)
    steps = {r.rid: eng.stats.records[r.rid].steps["admit"] for r in reqs}
    assert len(set(steps.values())) == len(reqs)  # one admission per step
    return sorted(steps, key=steps.__getitem__)


def mixed_queue() -> list[Req]:
    return [cold("c1", 200), hot("short", 16), cold("c2", 201), hot("long", 48), cold("c3", 202)]


def test_fcfs_admits_in_arrival_order_whatever_is_cached() -> None:
    reqs = mixed_queue()
    assert admission_order("fcfs", reqs) == ["c1", "short", "c2", "long", "c3"]
    # the control: the prefixes were cached, fcfs just did not look
    assert reqs[1].cached_tokens >= 16 and reqs[3].cached_tokens >= 48 and reqs[0].cached_tokens == 0


def test_lpm_admits_the_longest_cached_prefix_first_and_ties_in_arrival_order() -> None:
    reqs = mixed_queue()
    assert admission_order("lpm", reqs) == ["long", "short", "c1", "c2", "c3"]
    assert reqs[3].cached_tokens >= 48 and reqs[1].cached_tokens >= 16


@pytest.mark.parametrize(
    ("num_cold", "hot_rank"),
    [
        (LPM_MAX_WAITING - 1, 0),  # 128 waiting: lpm sorts, the hot request goes first
        (LPM_MAX_WAITING, 1),  # 129 waiting: arrival order for one step, then 128 wait and lpm sorts
    ],
)
def test_lpm_keeps_arrival_order_above_128_waiting(num_cold: int, hot_rank: int) -> None:
    reqs = [cold(f"c{i}", 100 + i) for i in range(num_cold)] + [hot("hot", 48)]
    order = admission_order("lpm", reqs)
    assert order.index("hot") == hot_rank
    assert [rid for rid in order if rid != "hot"] == [f"c{i}" for i in range(num_cold)]


def test_lpm_under_a_chunk_cache_keeps_arrival_order() -> None:
    eng = engine("lpm", cache="chunk")
    assert not eng.scheduler.sorts_by_prefix
    assert engine("lpm").scheduler.sorts_by_prefix  # the control: a tree turns the sort on
    assert admission_order("lpm", mixed_queue(), cache="chunk") == ["c1", "short", "c2", "long", "c3"]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_every_request_a_step_may_admit_is_a_prefill_candidate(policy: str) -> None:
    """What `Engine.step_once` must look at: under lpm a request deep in the queue can be admitted."""
    eng = engine(policy, max_running=2)
    eng.submit(Req("warm", PREFIX.copy(), 2))
    drain(eng)
    for req in [cold(f"c{i}", 200 + i) for i in range(4)] + [hot("hot", 48)]:
        eng.submit(req)
    candidates = {r.rid for r in eng.scheduler.prefill_candidates()}
    eng.step()
    admitted = {rid for rid, record in eng.stats.records.items() if record.steps.get("admit") == eng.scheduler.step}
    assert admitted == ({"hot", "c0"} if policy == "lpm" else {"c0", "c1"})
    assert admitted <= candidates
    assert len(candidates) == (5 if policy == "lpm" else 2)
    drain(eng)


def test_a_bad_policy_name_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^schedule policy must be one of fcfs, lpm; got 'sjf'$"):
        SchedulerConfig(schedule_policy="sjf")  # type: ignore[arg-type]


def test_the_cli_reads_the_policy_and_refuses_a_bad_one(capsys: pytest.CaptureFixture[str]) -> None:
    for verb in ("run", "serve"):
        source = ["--workload", "multi-turn"] if verb == "run" else []
        args = build_parser().parse_args([verb, *source, "--device", "cpu", "--schedule-policy", "lpm"])
        config, _model = engine_from_args(args)
        assert config.scheduler.schedule_policy == "lpm"
        default, _model = engine_from_args(build_parser().parse_args([verb, *source, "--device", "cpu"]))
        assert default.scheduler.schedule_policy == "fcfs"
    with pytest.raises(SystemExit) as stop:
        main(["run", "--workload", "multi-turn", "--schedule-policy", "sjf"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("kvscope run: error: ") and "'sjf'" in err and "fcfs" in err, err
