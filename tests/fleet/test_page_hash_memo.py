"""Tree snapshots reuse each node's page hashes from the last snapshot (kvscope/cache/tree/node.py,
page_hashes' memo): the rows equal those hashed afresh through inserts, splits and evictions, and a
snapshot of an unchanged tree hashes nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.cache.tree import node as tree_node
from kvscope.cache.tree.node import page_hashes, walk
from kvscope.planning import ReplayConfig, replay_requests
from kvscope.planning.brute_force import fleet_servers
from kvscope.workloads import generate


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(["shared-prefix", "multi-turn", "branching"]), st.integers(0, 40), st.sampled_from([1, 2, 4]))
def test_a_snapshot_between_changes_hashes_as_a_fresh_one(workload: str, seed: int, page_size: int) -> None:
    (server,) = fleet_servers(ReplayConfig(600, page_size), 600, 1)  # NOTE: small: evictions and splits
    requests = replay_requests(generate(workload, num_requests=24, seed=seed, vocab_size=64))
    for start in range(0, len(requests), 4):
        for request in requests[start : start + 4]:
            server.serve(request)
        cache = server.cache
        server.cache.check_integrity()
        fresh = page_hashes(walk(cache.root), page_size)
        assert {row.node_id: row.page_hashes for row in cache.export_nodes()} == fresh


def test_an_unchanged_tree_is_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    (server,) = fleet_servers(ReplayConfig(4096, 2), 4096, 1)
    for request in replay_requests(generate("shared-prefix", num_requests=8, seed=1, vocab_size=64)):
        server.serve(request)
    first = server.cache.export_nodes()
    hashed: list[int] = []
    real = tree_node.chained_digests
    monkeypatch.setattr(tree_node, "chained_digests", lambda *a: hashed.append(1) or real(*a))
    assert server.cache.export_nodes() == first
    assert hashed == []
