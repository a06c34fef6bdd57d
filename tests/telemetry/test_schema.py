"""The one schema declaration and its versions: column lists derive from it, a capture of
schema version 1 opens in every reader, a writer upgrades it, and insert events carry the
owner a tree rebuilt from a snapshot needs.

data/schema_v1.db was written by kvscope before events.principal (schema version 1):
`kvscope run --workload multi-turn --num-requests 10 --kv-tokens 384 --page-size 2`; its tree
snapshots are at steps 50 and 72, and node 21, alive at step 71, was born between them.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvscope.cache import NodeRow as CacheNodeRow
from kvscope.debug import build_report, stored_report
from kvscope.telemetry import (
    Capture,
    CaptureError,
    EventKind,
    NodeRow,
    PoolName,
    SQLRecorder,
    allocs_of_requests,
    eviction_log,
    eviction_summary,
    evictions_over_steps,
    recent_evictions,
    running_lengths,
    schema,
)

V1_CAPTURE = Path(__file__).parent / "data" / "schema_v1.db"
BORN_AFTER_LAST_SNAPSHOT = {21}  # in V1_CAPTURE, alive at step 71


def stored_version(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("SELECT value FROM kvscope_meta WHERE key = 'schema_version'").fetchone()[0])
    finally:
        conn.close()


def event_columns(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [row[1] for row in conn.execute("PRAGMA table_info(events)")]
    finally:
        conn.close()


@pytest.fixture
def v1_copy(tmp_path: Path) -> Path:
    path = tmp_path / "v1.db"
    shutil.copy(V1_CAPTURE, path)
    return path


def test_column_lists_are_the_tables_columns() -> None:
    assert tuple(c.name for c in schema.events.columns) == schema.EVENT_COLUMNS
    assert schema.EVENT_COLUMNS[0] == "run_id" and schema.EVENT_COLUMNS[-1] == "slots"  # the recorder's layout
    assert ("run_id", "step", *schema.TREE_NODE_COLUMNS) == schema.TREE_SNAPSHOT_COLUMNS
    assert NodeRow._fields == schema.TREE_NODE_COLUMNS
    assert CacheNodeRow is NodeRow  # the caches export snapshot rows


def test_only_later_columns_read_as_null_from_an_older_file() -> None:
    tier_columns = [
        *(f"host_{c}" for c in schema.POOL_COLUMNS),
        "cum_host_hit_tokens",
        "cum_written_tokens",
        "cum_loaded_tokens",
        "tier",
    ]
    routing = [
        "dispatch",
        "routed_cached_tokens",
        "elsewhere_cached_tokens",
        "page_hashes",
        "census",
        "num_bytes",
        "kind_counts",
        "groups",
        "evict_steps",
        "lock_carry",
        "request_carry",
        "miss_nodes",
        "request_sums",
    ]
    assert sorted(c.name for c in schema.added_after(1)) == sorted(
        ["principal", "visibility", *tier_columns, "full_used", *routing]
    )
    assert sorted(c.name for c in schema.added_after(2)) == sorted(["visibility", *tier_columns, "full_used", *routing])
    assert sorted(c.name for c in schema.added_after(3)) == sorted([*tier_columns, "full_used", *routing])
    assert sorted(c.name for c in schema.added_after(4)) == sorted(["full_used", *routing])
    assert sorted(c.name for c in schema.added_after(6)) == sorted(routing)
    assert sorted(c.name for c in schema.added_after(7)) == [
        "census",
        "evict_steps",
        "groups",
        "kind_counts",
        "lock_carry",
        "miss_nodes",
        "num_bytes",
        "request_carry",
        "request_sums",
    ]
    assert [c.name for c in schema.added_after(8)] == [
        "num_bytes",
        "kind_counts",
        "groups",
        "evict_steps",
        "lock_carry",
        "request_carry",
        "miss_nodes",
        "request_sums",
    ]
    assert [c.name for c in schema.added_after(9)] == [
        "kind_counts",
        "groups",
        "evict_steps",
        "lock_carry",
        "request_carry",
        "miss_nodes",
        "request_sums",
    ]
    assert [c.name for c in schema.added_after(10)] == [
        "evict_steps",
        "lock_carry",
        "request_carry",
        "miss_nodes",
        "request_sums",
    ]
    assert [c.name for c in schema.added_after(11)] == ["miss_nodes", "request_sums"]
    assert [c.name for c in schema.added_after(12)] == ["miss_nodes"]
    assert schema.added_after(schema.SCHEMA_VERSION) == []
    as_v1 = schema.columns_as_of(schema.events, 1)
    assert [c.name for c in as_v1] == list(schema.EVENT_COLUMNS)
    assert [c.name for c in as_v1 if c is not schema.events.c[c.name]] == ["principal"]


def test_the_v1_capture_is_what_it_claims() -> None:
    assert stored_version(V1_CAPTURE) == "1"
    assert "principal" not in event_columns(V1_CAPTURE)


def test_a_version_1_capture_opens_in_every_reader(v1_copy: Path) -> None:
    before = v1_copy.read_bytes()
    capture = Capture(v1_copy)
    assert capture.schema_version == 1
    assert len(capture.runs()) == 1 and not capture.usage(1).empty and not capture.requests(1).empty
    events = capture.events(1, limit=100_000)
    assert len(events) > 400 and events["principal"].isna().all()
    assert set(capture.event_counts(1).kind) >= {"insert", "evict", "match"}
    assert not capture.leak_checks(1).empty and capture.snapshot_steps(1) == [50, 72]
    assert tuple(capture.step_range(1).iloc[0]) == (1, 72)
    assert list(capture.latest_usage(1).step)[-1] == 72
    latest = capture.latest_usage(1).iloc[-1]  # version 5's full_used, computed as engine runs define it
    assert latest.full_used == latest.full_total - latest.full_available - latest.full_evictable
    assert capture.usage(1).full_used.notna().all()
    log = eviction_log(capture, 1, 50, 0)
    assert len(log) == int(eviction_summary(capture, 1)["num_evictions"].sum()) > 0
    assert log["regret_tokens"].sum() > 0
    assert int(evictions_over_steps(capture, 1, 10)["num_evictions"].sum()) == len(log)
    assert int(recent_evictions(capture, 1, 0).iloc[0]["num_evictions"]) == len(log)
    assert not running_lengths(capture, 1, 30).empty
    assert not allocs_of_requests(capture, 1, list(capture.requests(1).rid[:2])).empty
    tree = capture.tree_at(1, 71)
    assert set(tree.node_id) >= BORN_AFTER_LAST_SNAPSHOT
    born_later = tree[tree.node_id.isin(BORN_AFTER_LAST_SNAPSHOT)]
    assert born_later["owner"].isna().all()  # version 1 recorded no owner on inserts: none is shown
    assert tree[~tree.node_id.isin(BORN_AFTER_LAST_SNAPSHOT) & (tree.node_id != 0)]["owner"].notna().all()
    capture.close()
    report = build_report(v1_copy, 1)
    assert report.clean and report.through_seq == len(events) - 1
    stored = stored_report(Capture(v1_copy), 1)
    assert stored is None or stored.clean  # stored by the older kvscope: kept only if its producer matches
    assert v1_copy.read_bytes() == before, "a reader wrote to the capture"


def test_a_writer_upgrades_a_version_1_capture_and_keeps_its_runs(v1_copy: Path) -> None:
    old_events = Capture(v1_copy).events(1, limit=100_000)
    with SQLRecorder(v1_copy, level="full") as recorder:
        recorder.record(
            EventKind.INSERT,
            pool=PoolName.FULL,
            node_id=1,
            num_tokens=2,
            slots=np.array([3, 4]),
            aux=0,
            principal="carol",
        )
    assert stored_version(v1_copy) == str(schema.SCHEMA_VERSION)
    assert "principal" in event_columns(v1_copy)
    capture = Capture(v1_copy)
    assert capture.schema_version == schema.SCHEMA_VERSION
    pd.testing.assert_frame_equal(capture.events(1, limit=100_000), old_events)
    assert list(capture.events(2).principal) == ["carol"]


def test_a_capture_newer_than_this_kvscope_is_refused(v1_copy: Path) -> None:
    conn = sqlite3.connect(v1_copy)
    conn.execute("UPDATE kvscope_meta SET value = ? WHERE key = 'schema_version'", (str(schema.SCHEMA_VERSION + 1),))
    conn.commit()
    conn.close()
    with pytest.raises(CaptureError, match="newer kvscope"):
        Capture(v1_copy)


def test_nodes_born_after_the_last_snapshot_show_their_owners(tmp_path: Path) -> None:
    """A snapshot holds the root and alice's node 1; bob inserts node 2 under it, then a split puts
    node 3 above node 2: rebuilt later, every node names its owner (the upper piece keeps bob)."""
    path = tmp_path / "owners.db"
    with SQLRecorder(path, level="full") as recorder:
        recorder.tree_snapshot(
            0, [NodeRow(0, None, 0, "", 1, 0.0, 0, None, False, 0), NodeRow(1, 0, 4, "", 0, 0.0, 1, "alice", False, 4)]
        )
        recorder.step = 1
        recorder.record(
            EventKind.INSERT,
            pool=PoolName.FULL,
            rid="r2",
            node_id=2,
            num_tokens=6,
            slots=np.arange(6),
            aux=1,
            principal="bob",
        )
        recorder.step = 2
        recorder.record(EventKind.SPLIT, node_id=3, num_tokens=2, aux=2)
    tree = Capture(path).tree_at(1, 2).set_index("node_id")
    assert tree.loc[1, "owner"] == "alice"
    assert (tree.loc[2, "owner"], tree.loc[3, "owner"]) == ("bob", "bob")
    assert (tree.loc[3, "parent_id"], tree.loc[2, "parent_id"]) == (1, 3)
    assert (tree.loc[3, "num_tokens"], tree.loc[2, "num_tokens"], tree.loc[2, "depth_tokens"]) == (2, 4, 10)
