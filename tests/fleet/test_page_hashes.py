"""tree_snapshots.page_hashes: a kvscope cache's snapshot hashes its pages as its KV events do
(SGLang's chained page hash), and `kvscope attach` stores the engine's block hashes as the same bytes,
so replicas (and an attached engine) compare page by page."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.attach.recorder import page_hash_bytes
from kvscope.planning import ReplayConfig, replay_requests
from kvscope.planning.brute_force import fleet_servers
from kvscope.server.kv_events import cached_pages
from kvscope.telemetry.page_hash import split_page_hashes
from kvscope.workloads import generate


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(["shared-prefix", "multi-turn", "branching"]), st.integers(0, 40), st.sampled_from([1, 2, 4]))
def test_snapshot_page_hashes_are_the_kv_events_block_hashes(workload: str, seed: int, page_size: int) -> None:
    (server,) = fleet_servers(ReplayConfig(8192, page_size), 8192, 1)
    for request in replay_requests(generate(workload, num_requests=12, seed=seed, vocab_size=128)):
        server.serve(request)
    rows = server.cache.export_nodes()
    stored = [h for row in rows for h in split_page_hashes(row.page_hashes)]
    published = cached_pages(server.cache, page_size)
    assert len(stored) == len(set(stored)) == len(published)  # one hash per full page, each page once
    assert set(stored) == {page_hash_bytes(h) for h in published}
    for row in rows:  # a node's hashes cover its tokens, a page each
        assert row.page_hashes is not None and len(row.page_hashes) // 8 * page_size == row.num_tokens
