"""`kvscope replay --dp-size N --dispatch METHOD`: a trace routed among N simulated radix caches
(brute_force's server, one per replica, in this process) by kvscope.fleet.dispatch.Dispatcher,
with the fleet figures of kvscope/fleet/figures.py: per replica hit rate, routing loss, duplication.

NOTE: one request, as the single-cache replay serves it (brute_force.py), plus the routing
    cached[r]   replica r's own match length of the prompt (read without touching its LRU order)
    rank        Dispatcher.choose(prompt_len, cached); prefix_affinity routes on cached
    routing     routed = cached[rank], elsewhere = max of the others' (0 with one replica);
                loss = max(0, elsewhere - routed), as figures.routing_loss
    load        a replay serves one request at a time (no queue), so a replica's load is what was
                dispatched to it so far: total_requests and total_tokens balance those counts,
                and prefix_affinity passes over a replica AFFINITY_SLACK_REQUESTS above the least
Each replica has the whole `capacity`. Duplication is figures.duplication over the replicas'
trees at the end (their nodes' page hashes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import pandas as pd

from kvscope.fleet.dispatch import DISPATCH_METHODS, Dispatcher, check_method
from kvscope.fleet.figures import Duplication, duplication, loss_table, snapshot_pages
from kvscope.planning.replays import ReplayConfig, ceil_pages
from kvscope.planning.requests import ReplayRequest, trace_times_s


class ReplicaReplay(NamedTuple):
    rank: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    evicted_tokens: int
    peak_usage_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)


class FleetReplay(NamedTuple):
    dispatch: str
    replicas: list[ReplicaReplay]
    routing: pd.DataFrame  # figures.ROUTING_COLUMNS, one row
    duplication: Duplication
    num_skipped: int

    @property
    def hit_rate(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.replicas)
        return sum(r.hit_tokens for r in self.replicas) / max(prompt, 1)


def dispatch_methods(method: str) -> tuple[str, ...]:
    """`all` or one method (DispatchError, a ValueError, for an unknown one)."""
    return DISPATCH_METHODS if method == "all" else (check_method(method),)


def replay_fleet(requests: Sequence[ReplayRequest], config: ReplayConfig, dp_size: int, method: str) -> FleetReplay:
    from kvscope.planning.brute_force import fleet_servers  # NOTE: loads torch

    if config.scoped is not None:
        raise ValueError("--dp-size replays the radix cache; --cache scoped-radix is not supported with it")
    dispatcher = Dispatcher(method, dp_size)
    ps = config.page_size
    headroom = max((ceil_pages(r.seq_len, ps) for r in requests), default=ps) if config.convention == "tree" else 0
    servers = fleet_servers(config, config.capacity + headroom, dp_size)
    times_s = trace_times_s(requests)
    counts = [[0, 0, 0] for _ in range(dp_size)]  # NOTE: per rank: requests, prompt tokens, hit tokens
    per_request: list[tuple[str, int, int]] = []
    skipped = 0
    for i, request in enumerate(requests):
        cached = [server.peek(request) for server in servers]
        rank = dispatcher.choose(request.prompt_len, cached)
        servers[rank].now = float(times_s[i])
        hit, _ = servers[rank].serve(request)
        if config.convention == "tree":
            servers[rank].trim(config.capacity)
        skipped += hit < 0
        elsewhere = max((c for r, c in enumerate(cached) if r != rank), default=0)
        per_request.append((method, request.prompt_len, max(0, elsewhere - cached[rank])))
        counts[rank][0] += 1
        counts[rank][1] += request.prompt_len
        counts[rank][2] += max(hit, 0)
    replicas = [
        ReplicaReplay(r, n, p, h, servers[r].num_evicted, servers[r].peak_usage) for r, (n, p, h) in enumerate(counts)
    ]
    routing = loss_table(pd.DataFrame(per_request, columns=["dispatch", "prompt_tokens", "loss_tokens"]))
    pages = [snapshot_pages(pd.DataFrame(s.cache.export_nodes()))[0] for s in servers]
    return FleetReplay(method, replicas, routing, duplication(pages), skipped)


def fleet_json(result: FleetReplay) -> dict[str, Any]:
    routing = result.routing.iloc[0] if not result.routing.empty else None
    dup = result.duplication
    return {
        "dispatch": result.dispatch,
        "hit_rate": result.hit_rate,
        "num_skipped": result.num_skipped,
        "routing": {
            "prompt_tokens": 0 if routing is None else int(routing["prompt_tokens"]),
            "loss_tokens": 0 if routing is None else int(routing["loss_tokens"]),
            "loss_share": 0.0 if routing is None else float(routing["loss_share"]),
        },
        "duplication": {**dup._asdict(), "share": dup.share},
        "replicas": [{**r._asdict(), "hit_rate": r.hit_rate} for r in result.replicas],
    }


def format_fleet(header: str, results: Sequence[FleetReplay]) -> str:
    lines = [
        header,
        "",
        f"{'dispatch':<16} {'hit':>6} {'loss':>6} {'lost tok':>9} {'dup tok':>8} {'dup':>6}  per replica hit",
    ]
    for result in results:
        body = fleet_json(result)
        dup = result.duplication
        per_replica = " ".join(f"{r.hit_rate:.1%}" for r in result.replicas)
        lines.append(
            f"{result.dispatch:<16} {result.hit_rate:>6.1%} {body['routing']['loss_share']:>6.1%} "
            f"{body['routing']['loss_tokens']:>9} {dup.duplicated_tokens:>8} {dup.share:>6.1%}  {per_replica}"
        )
    return "\n".join(lines)
