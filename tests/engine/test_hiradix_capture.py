"""A hiradix run's capture (schema version 4): usage samples per tier, the copy counters and
host hits, tree snapshots with each node's tier, and events that replay from one snapshot to
the next with the tiers right. Checked against the SQLite file read independently, and against
a single-tier run whose host columns stay NULL."""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path

import pandas as pd
import pytest

from kvscope.app.runner import to_engine_requests
from kvscope.cache.hiradix import HiRadixCache
from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import MODEL_PRESETS
from kvscope.telemetry import Capture, EventKind, SQLRecorder, replay_tree
from kvscope.telemetry.schema import TREE_NODE_COLUMNS
from kvscope.workloads import generate

MODEL = MODEL_PRESETS["tiny"]
HOST_TOKENS = 700
COMPARED = ["node_id", "parent_id", "num_tokens", "lock_ref", "tier"]


def record_run(path: Path, kind: str, policy: str = "write_through") -> Engine:
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=622, page_size=1, max_running_requests=8, max_context_len=2048),
        cache=CacheConfig(kind=kind, write_policy=policy, host_tokens=HOST_TOKENS if kind == "hiradix" else None),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(chunked_prefill_size=64, snapshot_interval_steps=10),
        device="cpu",
        strict=True,
    )
    trace = generate("multi-turn", num_requests=40, seed=0, vocab_size=MODEL.vocab_size)
    with SQLRecorder(path, level="full") as recorder:
        engine = Engine(config, MODEL, recorder)
        requests = to_engine_requests(trace)
        for start in range(0, len(requests), 8):  # waves: later ones find earlier turns on the host
            engine.run(requests[start : start + 8])
        engine.check_integrity()
    return engine


@pytest.fixture(scope="module")
def hiradix_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Engine]:
    path = tmp_path_factory.mktemp("hiradix") / "run.db"
    return path, record_run(path, "hiradix")


def test_usage_has_both_tiers_and_the_copy_counters(hiradix_run: tuple[Path, Engine]) -> None:
    path, engine = hiradix_run
    cache = engine.memory.cache
    assert isinstance(cache, HiRadixCache)
    with sqlite3.connect(path) as conn:
        rows = pd.read_sql("SELECT * FROM usage ORDER BY step", conn)
        version = conn.execute("SELECT value FROM kvscope_meta WHERE key = 'schema_version'").fetchone()[0]
    assert int(version) >= 4  # the version that added the host tier, or a later one
    copies = Capture(path).events(1, kinds=[EventKind.WRITE, EventKind.LOAD], limit=None)
    written = int(copies.num_tokens[copies.kind == "write"].sum())
    loaded = int(copies.num_tokens[copies.kind == "load"].sum())
    host_total = engine.memory.host_terms().total  # type: ignore[union-attr]
    assert host_total >= HOST_TOKENS and set(rows["host_total"]) == {host_total}
    host_used = rows["host_total"] - rows["host_available"]
    assert host_used.max() > 0 and (host_used == rows["host_evictable"]).all()  # a clean run: the tree holds them
    for column in ("cum_written_tokens", "cum_loaded_tokens", "cum_host_hit_tokens"):
        assert rows[column].is_monotonic_increasing and rows[column].iloc[-1] > 0, column
    last = rows.iloc[-1]
    assert last["cum_written_tokens"] == written == cache.num_write_tokens
    assert last["cum_loaded_tokens"] == loaded == cache.num_load_back_tokens
    assert last["cum_host_hit_tokens"] <= last["cum_hit_tokens"]
    assert last["cum_host_hit_tokens"] == engine.stats.host_hit_tokens
    read = Capture(path).usage(1)  # the reader's downsampled series carries the same columns
    assert read["host_total"].max() == host_total and read["cum_written_tokens"].max() == written


def test_snapshots_name_each_nodes_tier_and_events_replay_between_them(hiradix_run: tuple[Path, Engine]) -> None:
    path, engine = hiradix_run
    capture = Capture(path)
    steps = capture.snapshot_steps(1)
    tiers_seen: set[str] = set()
    replayed_pairs = 0
    for before, after in itertools.pairwise(steps):
        start = capture.tree_at(1, before)  # a snapshot step: the snapshot as stored
        end = capture.tree_at(1, after)
        tiers_seen |= set(end["tier"])
        events = capture.events(1, step_range=(before + 1, after), limit=10_000_000)
        got = replay_tree(start, events)
        expected = end[list(TREE_NODE_COLUMNS)]
        pd.testing.assert_frame_equal(
            got[COMPARED].sort_values("node_id").reset_index(drop=True),
            expected[COMPARED].sort_values("node_id").reset_index(drop=True),
            check_dtype=False,
        )
        replayed_pairs += 1
    assert replayed_pairs >= 5
    assert tiers_seen >= {"device", "device+host", "host"}
    final = capture.tree_at(1, steps[-1])
    exported = {row.node_id: row.tier for row in engine.memory.cache.export_nodes()}
    assert dict(zip(final["node_id"], final["tier"], strict=True)) == exported


def test_host_events_are_in_the_capture(hiradix_run: tuple[Path, Engine]) -> None:
    path, _ = hiradix_run
    counts = Capture(path).event_counts(1).set_index("kind")["count"]
    for kind in (EventKind.WRITE, EventKind.LOAD, EventKind.ACK, EventKind.HOST_EVICT):
        assert counts.get(kind.value, 0) > 0, kind
    capture = Capture(path)
    reasons = capture.events(1, kinds=[EventKind.EVICT], limit=None, columns=["reason"]).reason.value_counts()
    pooled = capture.events(1, kinds=[EventKind.ALLOC, EventKind.FREE], limit=None, columns=["pool"])
    assert (pooled.pool == "host").sum() > 0
    assert reasons.get("to-host", 0) > 0


def test_a_single_tier_run_leaves_the_host_columns_null(tmp_path: Path) -> None:
    path = tmp_path / "radix.db"
    record_run(path, "radix")
    with sqlite3.connect(path) as conn:
        host = conn.execute("SELECT COUNT(*), COUNT(host_total), COUNT(cum_written_tokens) FROM usage").fetchone()
        tiers = {t for (t,) in conn.execute("SELECT DISTINCT tier FROM tree_snapshots")}
    assert host[0] > 0 and host[1:] == (0, 0)
    assert tiers == {"device"}
