"""The dispatch methods against their definitions (kvscope/fleet/dispatch.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvscope.fleet.dispatch import AFFINITY_SLACK_REQUESTS, DISPATCH_METHODS, Dispatcher, DispatchError


def test_round_robin_cycles_and_skips_a_dead_replica() -> None:
    d = Dispatcher("round_robin", 3)
    assert [d.choose(10) for _ in range(4)] == [0, 1, 2, 0]
    assert [d.choose(10, live=[True, False, True]) for _ in range(3)] == [2, 0, 2]


def test_total_requests_counts_each_choice_until_the_replica_reports() -> None:
    d = Dispatcher("total_requests", 2)
    assert [d.choose(5) for _ in range(4)] == [0, 1, 0, 1]
    d.loads(0, requests=0, tokens=0)
    assert d.choose(5) == 0


def test_total_tokens_prefers_the_lightest_replica_in_tokens() -> None:
    d = Dispatcher("total_tokens", 2)
    assert d.choose(1000) == 0
    assert d.choose(10) == 1
    assert d.choose(10) == 1  # 1000 vs 10 tokens: rank 1 again


def test_prefix_affinity_follows_the_cached_prefix_within_the_slack() -> None:
    d = Dispatcher("prefix_affinity", 2)
    for _ in range(AFFINITY_SLACK_REQUESTS):
        assert d.choose(100, cached_tokens=[0, 64]) == 1
    assert d.choose(100, cached_tokens=[0, 64]) == 1  # 4 above the least loaded: still within
    assert d.choose(100, cached_tokens=[0, 64]) == 0  # 5 above: passed over
    assert d.choose(100, cached_tokens=[0, 0]) == 0  # cached nowhere: the fewest requests


def test_bad_methods_and_sizes_are_one_clear_error() -> None:
    with pytest.raises(DispatchError, match="unknown dispatch method 'random'"):
        Dispatcher("random", 2)
    with pytest.raises(DispatchError, match="at least one replica"):
        Dispatcher("round_robin", 0)
    with pytest.raises(DispatchError, match="needs each replica"):
        Dispatcher("prefix_affinity", 2).choose(5)
    with pytest.raises(DispatchError, match="no replica is live"):
        Dispatcher("total_requests", 2).choose(5, live=[False, False])


@given(
    method=st.sampled_from(DISPATCH_METHODS),
    replicas=st.integers(1, 5),
    prompts=st.lists(
        st.tuples(st.integers(1, 500), st.lists(st.integers(0, 500), min_size=5, max_size=5)), max_size=40
    ),
)
def test_every_choice_is_a_live_replica_and_counted(
    method: str, replicas: int, prompts: list[tuple[int, list[int]]]
) -> None:
    d = Dispatcher(method, replicas)
    for prompt, cached in prompts:
        rank = d.choose(prompt, cached_tokens=cached[:replicas])
        assert 0 <= rank < replicas
    assert sum(load.requests for load in d.load) == len(prompts)
    assert sum(load.tokens for load in d.load) == sum(p for p, _ in prompts)
