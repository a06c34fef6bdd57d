"""The eviction log reads only what its page needs (issue 41.2): touches before the page's last
eviction, and the later matches of the chunks whose miss_nodes (schema version 13) name a row's
node or parent. It must give what reading every event gives. The reference here reads every
node touch of the run and finds each row's birth, last touch, parent and first later miss by
brute force over them; random recordings (hypothesis) have splits of splits, re-inserted node
ids, evictions of split and re-matched nodes, matches without a node or without a miss, many
chunks, and retention-dropped leading chunks."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from kvscope.telemetry import derived, schema
from kvscope.telemetry.carry import read_miss_nodes
from kvscope.telemetry.events import EventKind, EvictReason, PoolName
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.upgrade import upgrade
from tests.telemetry.test_packed_oracles import record_random_events
from tests.telemetry.test_request_sums import drop_request_sums, drop_version_13

TOUCHES = ("insert", "split", "match", "lock")


def reference_log(capture: Capture, run_id: int, limit: int, offset: int) -> pd.DataFrame:
    """The log from every event of the run, one row at a time (the definitions in derived.py)."""
    every = capture.events(run_id, limit=None)
    ev = every[every.kind == "evict"].iloc[offset : offset + limit]
    touches = every[every.kind.isin(TOUCHES)]
    rows = []
    for e in ev.itertuples(index=False):
        node, seq = int(e.node_id), int(e.seq)
        parent = _parent(touches, node, seq)
        born = _first(touches, (touches.node_id == node) & touches.kind.isin(["insert", "split"]) & (touches.seq < seq))
        last = touches[(touches.node_id == node) & (touches.seq < seq)]
        last = None if last.empty else last.iloc[-1]
        at = [node] if parent is None else [node, parent]
        again = _first(
            touches, (touches.kind == "match") & (touches.aux > 0) & touches.node_id.isin(at) & (touches.seq > seq)
        )
        rows.append(
            (
                seq,
                int(e.step),
                float(e.t_mono),
                e.pool,
                node,
                parent,
                int(e.num_tokens),
                e.reason,
                None if born is None else int(e.step) - int(born.step),
                None if born is None else float(e.t_mono) - float(born.t_mono),
                None if last is None else int(e.step) - int(last.step),
                None if last is None else float(e.t_mono) - float(last.t_mono),
                None if again is None else int(again.step),
                None if again is None else again.rid,
                0 if again is None else min(int(e.num_tokens), int(again.aux)),
            )
        )
    return pd.DataFrame(rows, columns=list(derived.EVICTION_LOG_COLUMNS))


def _first(frame: pd.DataFrame, mask: Any) -> Any:
    found = frame[mask]
    return None if found.empty else found.iloc[0]


def _parent(touches: pd.DataFrame, node: int, seq: int) -> int | None:
    for _ in range(derived.MAX_PARENT_HOPS):
        splits = touches[(touches.kind == "split") & (touches.aux == node) & (touches.seq < seq)]
        if not splits.empty:
            return int(splits.iloc[-1].node_id)  # its latest split's upper piece
        born = _first(touches, (touches.node_id == node) & touches.kind.isin(["insert", "split"]) & (touches.seq < seq))
        if born is None:
            return None
        if born.kind == "insert":
            return int(born.aux)
        node, seq = int(born.aux), int(born.seq)
    return None


OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "reinsert", "split", "match", "match", "lock", "evict", "evict", "flush"]),
        st.integers(0, 1_000),
        st.integers(0, 30),
    ),
    min_size=5,
    max_size=160,
)


def record(path: Path, ops: list[tuple[str, int, int]]) -> None:
    """A run of `ops` (what, a pick among the nodes so far, a token count), a chunk per flush."""
    nodes, next_node = [1], 2
    with SQLRecorder(path, level="full") as rec:
        for step, (what, pick, tokens) in enumerate(ops):
            rec.step = step // 3
            node = nodes[-1 - pick % min(len(nodes), 8)]  # NOTE: a recent node, so nodes meet again
            if what in ("insert", "split"):
                kind = EventKind.INSERT if what == "insert" else EventKind.SPLIT
                rec.record(kind, pool=PoolName.FULL, node_id=next_node, aux=node, num_tokens=tokens)
                nodes.append(next_node)
                next_node += 1
            elif what == "reinsert":  # NOTE: an id born again (a source whose ids are hashes)
                parent = nodes[(pick // 7) % len(nodes)]
                rec.record(EventKind.INSERT, pool=PoolName.FULL, node_id=node, aux=parent, num_tokens=tokens)
            elif what == "match":
                rec.record(
                    EventKind.MATCH, rid=f"r{step}", node_id=None if pick % 9 == 0 else node, num_tokens=3, aux=tokens
                )
            elif what == "lock":
                rec.record(EventKind.LOCK, rid=f"r{step}", node_id=node, num_tokens=tokens)
            elif what == "evict":
                reason = list(EvictReason)[pick % len(EvictReason)]
                rec.record(EventKind.EVICT, pool=PoolName.FULL, node_id=node, num_tokens=tokens, reason=reason)
            else:
                rec.flush()


def drop_leading_chunks(path: Path, num_chunks: int) -> None:
    """What retention leaves: the run's first `num_chunks` chunks gone, and the bound recorded."""
    with sqlite3.connect(path) as conn:
        kept = conn.execute("SELECT first_seq, first_step FROM event_chunks WHERE chunk = ?", (num_chunks,)).fetchone()
        if kept is None:
            return
        conn.execute("DELETE FROM event_columns WHERE chunk < ?", (num_chunks,))
        conn.execute("DELETE FROM event_chunks WHERE chunk < ?", (num_chunks,))
        conn.execute(
            "INSERT INTO event_retention (run_id, keep_events_s, max_bytes, first_seq, first_step, dropped_chunks,"
            " dropped_bytes) VALUES (1, 1.0, NULL, ?, ?, ?, 0)",
            (*kept, num_chunks),
        )
    conn.close()


def forget_miss_nodes(path: Path, every: int) -> None:
    """Every `every`-th chunk as one written before version 13 (miss_nodes NULL)."""
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE event_chunks SET miss_nodes = NULL WHERE chunk % ? = 0", (every,))
    conn.close()


def pages(total: int) -> list[tuple[int, int]]:
    """A row a page (no other row's reads to lean on), then all of them, then past the end."""
    return [(1, offset) for offset in range(total)] + [(50, 0), (2, total)]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, dropped=st.integers(0, 3), forget=st.integers(0, 3))
def test_the_bounded_log_equals_reading_every_event(
    tmp_path_factory: Any, ops: list[tuple[str, int, int]], dropped: int, forget: int
) -> None:
    path = tmp_path_factory.mktemp("evlog") / "run.db"
    record(path, ops)
    drop_leading_chunks(path, dropped)
    if forget:
        forget_miss_nodes(path, forget + 1)
    capture = Capture(path)
    try:
        total = int((capture.events(1, limit=None, columns=["kind"]).kind == "evict").sum())
        for limit, offset in pages(total):
            log = derived.eviction_log(capture, 1, limit, offset)
            expected = reference_log(capture, 1, limit, offset)
            assert len(log) == len(expected) == max(0, min(limit, total - offset))
            if len(log):
                pd.testing.assert_frame_equal(log, expected, check_dtype=False)
    finally:
        capture.close()


def test_miss_nodes_name_the_nodes_of_a_chunks_missing_matches(tmp_path: Path) -> None:
    path = tmp_path / "run.db"
    with SQLRecorder(path, level="full") as rec:
        for node, miss in ((5, 0), (3, 2), (9, 1), (3, 4), (None, 7)):
            rec.record(EventKind.MATCH, rid="r", node_id=node, num_tokens=1, aux=miss)
        rec.record(EventKind.LOCK, rid="r", node_id=4, num_tokens=1, aux=9)
        rec.flush()
        rec.record(EventKind.MATCH, rid="r", node_id=5, num_tokens=1, aux=0)
    with sqlite3.connect(path) as conn:
        stored = [bytes(b) for (b,) in conn.execute("SELECT miss_nodes FROM event_chunks ORDER BY chunk")]
    conn.close()
    assert [read_miss_nodes(b).tolist() for b in stored] == [[3, 9], []]
    assert schema.event_chunks.c.miss_nodes.info["since"] == schema.MISS_NODES_SINCE == 13
    capture = Capture(path)
    try:
        carried = capture.packed.carried(1, capture.schema_version, "miss_nodes")
        assert [bytes(b) for b in carried.miss_nodes] == stored
    finally:
        capture.close()
    forget_miss_nodes(path, 1)
    capture = Capture(path)
    try:  # NOTE: computed from the columns where NULL
        computed = capture.packed.carried(1, capture.schema_version, "miss_nodes")
        assert [np.frombuffer(bytes(b), "<i8").tolist() for b in computed.miss_nodes] == [[3, 9], []]
    finally:
        capture.close()


def test_a_version_11_file_reads_the_same_log_and_upgrade_stores_miss_nodes(tmp_path: Path) -> None:
    path, older = tmp_path / "run.db", tmp_path / "v11.db"
    record_random_events(path, 3)
    shutil.copy(path, older)
    with sqlite3.connect(older) as conn:
        drop_version_13(conn)
        drop_request_sums(conn)
        conn.execute("UPDATE kvscope_meta SET value = '11' WHERE key = 'schema_version'")
    conn.close()
    logs = {}
    for name in ("new", "v11", "upgraded"):
        if name == "upgraded":
            assert [r.summarized for r in upgrade(older)] == [len(stored_miss_nodes(path))]
        capture = Capture(path if name == "new" else older)
        try:
            logs[name] = derived.eviction_log(capture, 1, 200, 0)
        finally:
            capture.close()
    assert len(logs["new"]) > 20
    pd.testing.assert_frame_equal(logs["v11"], logs["new"])
    pd.testing.assert_frame_equal(logs["upgraded"], logs["new"])
    assert stored_miss_nodes(older) == stored_miss_nodes(path)


def stored_miss_nodes(path: Path) -> list[bytes | None]:
    with sqlite3.connect(path) as conn:
        found = [r for (r,) in conn.execute("SELECT miss_nodes FROM event_chunks ORDER BY chunk")]
    conn.close()
    return found


def test_a_miss_before_the_eviction_in_its_chunk_is_not_its_regret(tmp_path: Path) -> None:
    """The eviction's own chunk names the node (a miss before the eviction): the regret is the
    miss two chunks later, past a chunk that does not name it."""
    path = tmp_path / "run.db"
    with SQLRecorder(path, level="full") as rec:
        rec.step = 1
        rec.record(EventKind.INSERT, pool=PoolName.FULL, node_id=2, aux=1, num_tokens=8)
        rec.record(EventKind.MATCH, rid="a", node_id=2, num_tokens=1, aux=5)
        rec.record(EventKind.EVICT, pool=PoolName.FULL, node_id=2, num_tokens=6, reason=EvictReason.CAPACITY)
        rec.record(EventKind.MATCH, rid="b", node_id=3, num_tokens=1, aux=5)
        rec.flush()
        rec.step = 2
        rec.record(EventKind.MATCH, rid="c", node_id=4, num_tokens=1, aux=5)
        rec.flush()
        rec.step = 3
        rec.record(EventKind.MATCH, rid="d", node_id=2, num_tokens=1, aux=4)
    capture = Capture(path)
    try:
        log = derived.eviction_log(capture, 1, 10, 0)
    finally:
        capture.close()
    assert log[["node_id", "parent_id", "needed_again_step", "needed_again_by", "regret_tokens"]].values.tolist() == [
        [2, 1, 3, "d", 4]
    ]


def test_the_first_arrival_is_one_seek_of_its_index_and_upgrade_adds_it(tmp_path: Path) -> None:
    """Version 13's ix_requests_arrive_t: a writer makes it, an upgrade of a version-12 file adds it,
    and the first arrival's query reads through it (not every request row)."""
    path = tmp_path / "run.db"
    record_random_events(path, 1, num_steps=10)
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO requests (run_id, rid, status, prompt_len, cached_tokens, output_len, num_retractions,"
            " arrive_step, arrive_t) VALUES (1, ?, 'finished', 1, 0, 1, 0, ?, ?)",
            [(f"q{i}", i, t) for i, t in enumerate((7.5, 3.25, None, 9.0))],
        )
        conn.execute("DROP INDEX ix_requests_arrive_t")
        conn.execute("UPDATE kvscope_meta SET value = '12' WHERE key = 'schema_version'")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN miss_nodes")
    conn.close()
    upgrade(path)
    capture = Capture(path)
    try:
        assert capture.first_arrival(1) == 3.25
        c = schema.requests.c
        stmt = select(func.min(c.arrive_t)).where(c.run_id == 1)
        with capture.engine.connect() as conn:
            plan = " ".join(str(r) for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled(stmt)}").fetchall())
    finally:
        capture.close()
    assert "COVERING INDEX ix_requests_arrive_t" in plan, plan  # NOTE: arrive_t read from the index itself


def compiled(stmt: Any) -> str:
    return str(stmt.compile(compile_kwargs={"literal_binds": True}))
