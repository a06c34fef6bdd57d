"""Scoped replays and the isolated one-pass curve: keys namespaced by principal, the scoped radix
cache replayed on trace time, and `kvscope replay --cache scoped-radix`. Each negative (no
cross-principal hit) is paired with its positive control (global sharing hits there)."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvscope.app import build_parser
from kvscope.planning import (
    ReplayConfig,
    ReplayRequest,
    ScopedOptions,
    one_pass_curve,
    replay,
    replay_requests,
    trace_times_s,
)
from kvscope.workloads import generate, write_trace
from tests.planning.helpers import random_trace

INF = ScopedOptions(promote_k=None)


def with_users(requests: list[ReplayRequest], num_users: int) -> list[ReplayRequest]:
    return [r._replace(user=f"u{i % num_users}") for i, r in enumerate(requests)]


def request(rid: str, user: str | None, prompt: list[int], output: list[int]) -> ReplayRequest:
    ids = np.array(prompt + output, dtype=np.int32)
    return ReplayRequest(rid, ids[: len(prompt)].copy(), ids, user)


def multi_tenant(num_requests: int = 40, rate_per_s: float | None = None) -> list[ReplayRequest]:
    return replay_requests(generate("multi-tenant", num_requests=num_requests, seed=0, rate_per_s=rate_per_s))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 4]))
def test_one_principal_gives_the_global_curve(seed: int, page_size: int) -> None:
    requests = with_users(random_trace(seed, 30, page_size), 1)
    glob, isolated = one_pass_curve(requests, page_size), one_pass_curve(requests, page_size, isolated=True)
    for field in ("request", "start", "length"):
        assert np.array_equal(getattr(glob.ramps, field), getattr(isolated.ramps, field))


def test_the_isolated_curve_never_shares_across_principals() -> None:
    prompt = list(range(10, 30))
    requests = [request("a", "alice", prompt, [1]), request("b", "bob", prompt, [2])]
    isolated = one_pass_curve(requests, isolated=True)
    assert isolated.request_hit_tokens(1000).tolist() == [0, 0]
    assert isolated.working_set_tokens == 42
    # NOTE: the positive controls: global sharing hits, and so does the same principal asking again
    assert one_pass_curve(requests).request_hit_tokens(1000).tolist() == [0, 20]
    same = [requests[0], requests[1]._replace(user="alice")]
    assert one_pass_curve(same, isolated=True).request_hit_tokens(1000).tolist() == [0, 20]


@settings(max_examples=20, deadline=None)
@example(seed=0, page_size=1, num_users=2)
@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 4]), num_users=st.integers(1, 3))
def test_the_isolated_curve_is_a_scoped_replay_with_k_inf_and_room(seed: int, page_size: int, num_users: int) -> None:
    requests = with_users(random_trace(seed, 30, page_size), num_users)
    isolated = one_pass_curve(requests, page_size, isolated=True)
    capacity = -(-isolated.working_set_tokens // page_size) * page_size
    result = replay(requests, ReplayConfig(capacity, page_size, "page", "tree", scoped=INF), check_integrity=True)
    assert result.num_cross_hit_tokens == 0
    assert result.request_hit_tokens.tolist() == isolated.request_hit_tokens(capacity).tolist()


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    page_size=st.sampled_from([1, 4]),
    num_users=st.integers(2, 3),
    share=st.sampled_from([0.25, 0.5, 0.8]),
)
def test_under_eviction_pressure_the_k_inf_replay_still_equals_the_isolated_curve(
    seed: int, page_size: int, num_users: int, share: float
) -> None:
    """Page-granular eviction keeps one recency order over the forest of namespaces (the unmatched
    lower piece of a split keeps its own stamp, as in RadixCache), so the curve is exact below the
    working set too."""
    requests = with_users(random_trace(seed, 30, page_size), num_users)
    isolated = one_pass_curve(requests, page_size, isolated=True)
    capacity = max(page_size, int(isolated.working_set_tokens * share) // page_size * page_size)
    result = replay(requests, ReplayConfig(capacity, page_size, "page", "tree", scoped=INF), check_integrity=True)
    assert result.request_hit_tokens.tolist() == isolated.request_hit_tokens(capacity).tolist()


def test_a_non_owner_never_hits_a_private_token_it_did_not_compute() -> None:
    """u1's private [0, 0, 2] and u0's later [0, 2, 0, 0] share only their first token, which u0
    never computed; u0 must match 0 there and its copy must not hang below u1's node. (The test
    above flagged this once, against a deliberately broken visibility check.)"""
    requests = [
        request("r0", "u0", [1, 0, 2, 0, 2], [0, 0]),
        request("r1", "u1", [0, 0], [2]),
        request("r2", "u0", [0, 2, 0], [0]),
    ]
    scoped = replay(requests, ReplayConfig(64, 1, "page", "tree", scoped=INF), check_integrity=True)
    assert scoped.request_hit_tokens.tolist() == [0, 0, 0]
    # NOTE: the positive control: global sharing serves r2's first token from r1's node
    assert replay(requests, ReplayConfig(64, 1, "page", "tree")).request_hit_tokens.tolist() == [0, 0, 1]


def test_k_inf_never_serves_another_principal_and_costs_hits() -> None:
    requests = multi_tenant()
    for capacity in (1_000, 4_000, 100_000):
        glob = replay(requests, ReplayConfig(capacity, 1, "page", "tree"))
        scoped = replay(requests, ReplayConfig(capacity, 1, "page", "tree", scoped=INF), check_integrity=True)
        assert scoped.num_cross_hit_tokens == 0
        assert scoped.num_hit_tokens > 0  # NOTE: a user's own session turns still hit
        # NOTE: the positive control: global sharing serves the common and tenant prompts across users
        assert glob.num_cross_hit_tokens > 0
        assert scoped.num_hit_tokens < glob.num_hit_tokens
        assert scoped.cache_stats is not None and scoped.cache_stats["cross_hit_tokens"] == 0
        json.dumps(scoped.cache_stats)  # NOTE: the stats travel in --json


def test_k_1_with_an_epoch_per_request_is_global_sharing() -> None:
    """Index clock (no arrival times): request i at i s; with 1 s epochs each request's nodes are
    promoted at the next boundary, while their creator is still in the window."""
    requests = multi_tenant()
    assert all(r.arrival_s is None for r in requests)
    k1 = ScopedOptions(promote_k=1, epoch_s=1.0)
    # NOTE: at 300 and 600 tokens one request of 40 differs: the two caches' eviction orders
    # part under that pressure (an open question for the scoped cache, not pinned here)
    for capacity, convention in ((2_000, "tree"), (100_000, "tree"), (2_000, "slots")):
        glob = replay(requests, ReplayConfig(capacity, 1, "page", convention))
        scoped = replay(requests, ReplayConfig(capacity, 1, "page", convention, scoped=k1), check_integrity=True)
        assert scoped.request_hit_tokens.tolist() == glob.request_hit_tokens.tolist(), capacity
    # NOTE: the control: with one epoch for the whole trace no boundary ever promotes, so k = 1
    # serves exactly what k = inf does, less than global sharing
    config = ReplayConfig(100_000, 1, "page", "tree")
    never = replay(requests, replace(config, scoped=ScopedOptions(promote_k=1, epoch_s=1e6)))
    isolated = replay(requests, replace(config, scoped=INF))
    assert never.request_hit_tokens.tolist() == isolated.request_hit_tokens.tolist()
    assert never.num_hit_tokens < replay(requests, config).num_hit_tokens


def test_a_pinned_prefix_hits_for_every_principal() -> None:
    prompt = list(range(10, 42))
    requests = [request("a", "alice", [*prompt, 50, 51], [1]), request("b", "bob", [*prompt, 60, 61], [2])]
    pinned = ScopedOptions(promote_k=None, pinned=(tuple(prompt),))
    hits = replay(requests, ReplayConfig(1_000, 1, "page", "tree", scoped=pinned), check_integrity=True)
    assert hits.request_hit_tokens.tolist() == [0, 32]
    # NOTE: the negative: without the pin, bob cannot see alice's copy
    isolated = replay(requests, ReplayConfig(1_000, 1, "page", "tree", scoped=INF), check_integrity=True)
    assert isolated.request_hit_tokens.tolist() == [0, 0]


def test_trace_time_is_arrival_made_monotone_else_the_index() -> None:
    requests = [request(str(i), None, [i + 5], [1])._replace(arrival_s=t) for i, t in enumerate([0.0, 3.0, 2.0, 5.0])]
    assert trace_times_s(requests).tolist() == [0.0, 3.0, 3.0, 5.0]
    requests[2] = requests[2]._replace(arrival_s=None)
    assert trace_times_s(requests).tolist() == [0.0, 1.0, 2.0, 3.0]


def replay_cli(*argv: str) -> str:
    args = build_parser().parse_args(["replay", *argv])
    out = io.StringIO()
    assert args.func(args, out, io.StringIO()) == 0
    return out.getvalue()


def test_replay_cli_prints_both_curves_and_the_scoped_cost(tmp_path: Path) -> None:
    trace = tmp_path / "mten.jsonl"
    write_trace(trace, generate("multi-tenant", num_requests=40, seed=0))
    common = [
        str(trace),
        "--capacities",
        "1k,4k",
        "--convention",
        "tree",
        "--eviction-granularity",
        "page",
        "--workers",
        "2",
    ]
    text = replay_cli(*common, "--cache", "scoped-radix", "--promote-k", "inf")
    assert "isolated      one pass with keys per principal" in text
    assert "one-pass isolated" in text and "scoped hit" in text and "k=inf, epoch 60 s" in text
    assert "clock = the request's index x 1 s" in text
    data: dict[str, Any] = json.loads(replay_cli(*common, "--cache", "scoped-radix", "--promote-k", "inf", "--json"))
    assert data["cache"] == "scoped-radix" and data["scoped"]["promote_k"] is None
    assert data["isolated_curve"]["max_hit_rate"] < data["curve"]["max_hit_rate"]
    for row in data["rows"]:
        assert row["scoped_hit_rate"] < row["hit_rate"] and row["cross_hit_tokens"] > 0
        assert row["isolated_curve_hit_rate"] < row["curve_hit_rate"]
    same = json.loads(replay_cli(*common, "--cache", "scoped-radix", "--promote-k", "1", "--epoch-s", "1", "--json"))
    assert [row["scoped_hit_tokens"] for row in same["rows"]] == [row["hit_tokens"] for row in same["rows"]]
    plain = json.loads(replay_cli(*common, "--json"))
    assert plain["cache"] == "radix" and plain["isolated_curve"] is None and "scoped_hit_rate" not in plain["rows"][0]
    only = replay_cli(str(trace), "--cache", "scoped-radix", "--curve-only", "--capacities", "1k")
    assert "one-pass isolated" in only
