"""`kvscope replay --dp-size N --dispatch METHOD`: the fleet replay's figures and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.app import main
from kvscope.planning import ReplayConfig, replay_requests
from kvscope.planning.brute_force import fleet_servers, replay
from kvscope.planning.fleet_replay import replay_fleet
from kvscope.workloads import generate, write_trace

WORKLOADS = ("shared-prefix", "multi-tenant", "multi-turn")


def requests_of(workload: str, seed: int, num_requests: int = 24) -> list:
    return replay_requests(generate(workload, num_requests=num_requests, seed=seed, vocab_size=256))


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(WORKLOADS), st.integers(0, 50), st.sampled_from([1, 2]), st.sampled_from([600, 3000]))
def test_one_replica_is_the_plain_replay_and_loses_nothing(
    workload: str, seed: int, page_size: int, capacity: int
) -> None:
    requests = requests_of(workload, seed)
    config = ReplayConfig(capacity, page_size)
    plain = replay(requests, config)
    for method in ("round_robin", "prefix_affinity"):
        fleet = replay_fleet(requests, config, 1, method)
        assert fleet.hit_rate == plain.hit_rate
        assert fleet.replicas[0].evicted_tokens == plain.num_evicted_tokens
        assert fleet.routing["loss_tokens"].tolist() == [0]
        assert fleet.duplication.duplicated_tokens == 0


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(WORKLOADS), st.integers(0, 50), st.integers(2, 3))
def test_fleet_replay_duplication_adds_up(workload: str, seed: int, dp_size: int) -> None:
    result = replay_fleet(requests_of(workload, seed), ReplayConfig(3000, 1), dp_size, "round_robin")
    dup = result.duplication
    assert dup.unique_tokens + dup.duplicated_tokens == dup.held_tokens
    assert sum(r.num_requests for r in result.replicas) == 24


@settings(max_examples=8, deadline=None)
@given(st.sampled_from(WORKLOADS), st.integers(0, 50), st.sampled_from([1, 4]))
def test_peek_is_the_match_length_without_touching_the_tree(workload: str, seed: int, page_size: int) -> None:
    requests = requests_of(workload, seed)
    (server,) = fleet_servers(ReplayConfig(4096, page_size), 4096, 1)
    for request in requests:
        before = server.cache.export_nodes()
        peeked = server.peek(request)
        assert server.cache.export_nodes() == before  # no split, no access time changed
        assert peeked == len(server.cache.match_prefix(request.prompt_ids).device_indices)
        server.serve(request)


def test_two_replicas_of_a_shared_prefix_duplicate_it_under_round_robin() -> None:
    """Round robin sends the shared prefix's requests to both replicas: both cache it."""
    result = replay_fleet(requests_of("shared-prefix", 3), ReplayConfig(8000, 1), 2, "round_robin")
    assert result.duplication.duplicated_tokens > 0


def test_replay_dp_size_json_compares_every_method(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate("shared-prefix", num_requests=20, seed=1, vocab_size=256))
    assert main(["replay", str(trace), "--dp-size", "2", "--capacities", "2k", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dp_size"] == 2 and report["capacity_per_replica"] == 2000
    assert [m["dispatch"] for m in report["methods"]] == [
        "round_robin",
        "total_requests",
        "total_tokens",
        "prefix_affinity",
    ]
    for method in report["methods"]:
        assert len(method["replicas"]) == 2
        dup = method["duplication"]
        assert dup["unique_tokens"] + dup["duplicated_tokens"] == dup["held_tokens"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dp-size", "0", "--capacities", "1k"], "--dp-size must be >= 1"),
        (["--dp-size", "1000000", "--capacities", "1k"], "--dp-size 1,000,000 is more replicas than"),
        (["--dp-size", "5", "--capacities", "1k"], "has requests (4): give at most 4"),
        (["--dp-size", "2", "--capacities", "1k,2k"], "one capacity per replica"),
        (["--dp-size", "2"], "one capacity per replica"),
        (["--dp-size", "2", "--capacities", "1k", "--curve-only"], "--curve-only"),
        (["--dp-size", "2", "--capacities", "1k", "--cache", "scoped-radix"], "scoped-radix is not supported"),
        (["--dispatch", "round_robin", "--capacities", "1k"], "give --dp-size N too"),
        (["--dp-size", "2", "--capacities", "1k", "--dispatch", "fastest"], "unknown dispatch method 'fastest'"),
    ],
)
def test_replay_dp_size_bad_input_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate("shared-prefix", num_requests=4, seed=1, vocab_size=64))
    assert main(["replay", str(trace), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
