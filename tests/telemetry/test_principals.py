"""Tenants of principals, schema version 3 (tree snapshots carry each node's visibility) and the
reads of cache sharing: a version-2 capture upgrades with every row kept and reads as public,
promote and demote events replay onto the tree, and cross-principal reuse adds up per principal."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvscope.telemetry import (
    Capture,
    EventKind,
    NodeRow,
    PoolName,
    SQLRecorder,
    Visibility,
    reuse_by_principal,
    run_principals,
    schema,
    tenant_of,
    visibility_changes,
)

ROOT = Path(__file__).resolve().parents[2]
V2_CAPTURE = ROOT / "tests" / "telemetry" / "data" / "schema_v2.db"  # sample_runs/shared-prefix.db as schema 2 wrote it
NAME = st.text(st.characters(blacklist_characters="/-", blacklist_categories=("Cs",)), min_size=1, max_size=8)


def stored_version(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("SELECT value FROM kvscope_meta WHERE key = 'schema_version'").fetchone()[0])
    finally:
        conn.close()


def snapshot_rows(path: Path) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT * FROM tree_snapshots ORDER BY run_id, step, node_id").fetchall()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("principal", "tenant"),
    [
        ("acme/alice", "acme"),
        ("acme/al-ice", "acme"),
        ("t1-u2", "t1"),
        ("t1-u2-x", "t1"),
        ("alice", "alice"),
        ("/alice", ""),
        (None, None),
    ],
)
def test_tenant_of_cuts_at_the_first_slash_else_the_first_dash(principal: str | None, tenant: str | None) -> None:
    assert tenant_of(principal) == tenant


@given(tenant=NAME, user=st.text(max_size=8))
def test_the_slash_wins_over_the_dash(tenant: str, user: str) -> None:
    assert tenant_of(f"{tenant}/{user}") == tenant
    if "/" not in user:  # a slash anywhere wins: "t-a/b" is tenant "t-a"
        assert tenant_of(f"{tenant}-{user}") == tenant  # the positive for the dash on its own
    assert tenant_of(tenant) == tenant


def test_version_3_adds_only_tree_visibility() -> None:
    assert [c.name for c in schema.added_after(2) if schema.since_version(c) == 3] == ["visibility"]
    assert "visibility" in schema.TREE_NODE_COLUMNS and "visibility" in NodeRow._fields
    assert NodeRow(0, None, 0, "", 1, 0.0, 0, None, False, 0).visibility == "public"


def test_a_version_2_capture_reads_as_public_and_upgrades_keeping_every_row(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    shutil.copy(V2_CAPTURE, path)
    assert stored_version(path) == "2"
    capture = Capture(path)
    steps = capture.snapshot_steps(1)
    before_events = capture.events(1, limit=10_000_000)
    before_tree = capture.tree_at(1, steps[-1])
    assert len(before_tree) > 1 and set(before_tree["visibility"]) == {"public"}
    before_rows = snapshot_rows(path)
    capture.close()
    with SQLRecorder(path, level="summary") as recorder:  # a writer brings the file up to the current version
        recorder.tree_snapshot(
            1,
            [
                NodeRow(0, None, 0, "", 1, 0.0, 0, None, False, 0),
                NodeRow(1, 0, 4, "", 0, 0.0, 1, "t1-a", False, 4, "private"),
            ],
        )
    assert stored_version(path) == str(schema.SCHEMA_VERSION)
    after = snapshot_rows(path)
    added = len(after[0]) - len(before_rows[0])  # the snapshot columns of versions 3, 4 and 7
    assert added == 3
    assert [row[:-added] for row in after[: len(before_rows)]] == before_rows  # every older row, unchanged
    assert {row[-added:] for row in after[: len(before_rows)]} == {(None,) * added}  # stored NULL ...
    capture = Capture(path)
    pd.testing.assert_frame_equal(capture.tree_at(1, steps[-1]), before_tree)  # ... read as public
    pd.testing.assert_frame_equal(capture.events(1, limit=10_000_000), before_events)
    assert capture.tree_at(2, 1).set_index("node_id").loc[1, "visibility"] == "private"  # the new run's own


def test_promote_and_demote_replay_onto_the_tree(tmp_path: Path) -> None:
    """Snapshot: root, 1 (private, alice) with child 2 (private, alice). A promote makes 1 public;
    a demote of 1 makes 1 and 2 private again; node 3, inserted after the snapshot, is private as
    its insert event's reason says until the promote names it; node 4, inserted with no reason (a
    global-sharing tree), is public."""
    path = tmp_path / "vis.db"
    with SQLRecorder(path, level="full") as recorder:
        recorder.tree_snapshot(
            0,
            [
                NodeRow(0, None, 0, "", 1, 0.0, 0, None, False, 0),
                NodeRow(1, 0, 4, "", 0, 0.0, 1, "alice", False, 4, "private"),
                NodeRow(2, 1, 2, "", 0, 0.0, 1, "alice", False, 6, "private"),
            ],
        )
        recorder.step = 1
        recorder.record(
            EventKind.INSERT,
            pool=PoolName.FULL,
            node_id=3,
            num_tokens=3,
            slots=np.arange(3),
            aux=0,
            principal="bob",
            reason=Visibility.PRIVATE,
        )
        recorder.record(
            EventKind.INSERT,
            pool=PoolName.FULL,
            node_id=4,
            num_tokens=1,
            slots=np.arange(3, 4),
            aux=0,
            principal="carol",
        )
        recorder.step = 2
        recorder.record(EventKind.PROMOTE, node_id=1, num_tokens=4, aux=2, principal="alice")
        recorder.record(EventKind.PROMOTE, node_id=3, num_tokens=3, aux=2, principal="bob")
        recorder.step = 3
        recorder.record(EventKind.DEMOTE, node_id=1, num_tokens=6, aux=2, principal="alice,bob")
    capture = Capture(path)
    visibility = {step: capture.tree_at(1, step).set_index("node_id")["visibility"] for step in (1, 2, 3)}
    assert (visibility[1][2], visibility[1][3], visibility[1][4]) == ("private", "private", "public")
    assert (visibility[2][1], visibility[2][2], visibility[2][3]) == ("public", "private", "public")
    assert (visibility[3][1], visibility[3][2], visibility[3][3]) == ("private", "private", "public")
    changes = visibility_changes(capture, 1)
    assert changes.to_dict("records") == [
        {"step": 2, "kind": "promote", "num_events": 2, "num_tokens": 7},
        {"step": 3, "kind": "demote", "num_events": 1, "num_tokens": 6},
    ]


@pytest.fixture(scope="module")
def multi_tenant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mt") / "mt.db"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "run",
            "--workload",
            "multi-tenant",
            "--num-requests",
            "24",
            "--cache",
            "radix",
            "--capture",
            str(path),
            "--no-report",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return path


def test_a_radix_run_names_requesters_and_counts_cross_principal_reuse(multi_tenant: Path) -> None:
    capture = Capture(multi_tenant)
    names = run_principals(capture, 1)
    assert names == sorted(set(capture.requests(1)["principal"]))
    reuse = reuse_by_principal(capture, 1).set_index("principal")
    matches = capture.events(1, kinds=[EventKind.MATCH], limit=10_000)
    cross = capture.events(1, kinds=[EventKind.CROSS_HIT], limit=10_000)
    assert set(matches["principal"]) == set(names)  # every match names its requester
    assert reuse["matched_tokens"].to_dict() == matches.groupby("principal")["num_tokens"].sum().to_dict()
    assert int(reuse["cross_tokens"].sum()) == int(cross["num_tokens"].sum()) > 0
    assert (reuse["cross_tokens"] <= reuse["matched_tokens"]).all()
    assert visibility_changes(capture, 1).empty  # global sharing never promotes
    last = capture.snapshot_steps(1)[-1]
    assert set(capture.tree_at(1, last)["visibility"]) == {"public"}


def test_an_older_capture_has_no_reuse_to_show() -> None:
    capture = Capture(V2_CAPTURE)
    assert reuse_by_principal(capture, 1).empty and run_principals(capture, 1)
