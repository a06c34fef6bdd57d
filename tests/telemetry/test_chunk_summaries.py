"""Chunk summaries (schema version 10): each chunk's events per kind and its match events' principals,
stored as it is written, so the Overview's event counts and the sidebar's principals read chunk rows
instead of every event. They must give what the events give: on random recordings, against the
events themselves; with some chunks written before version 10 (no summaries); and after `kvscope
upgrade` stored the missing ones."""

from __future__ import annotations

import json
import shutil
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.app import main
from kvscope.telemetry import derived, schema, sharing
from kvscope.telemetry.event_source import match_principals
from kvscope.telemetry.events import EventKind, EvictReason, PoolName
from kvscope.telemetry.packed import NO_CODE, summaries
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.retention import Retention
from kvscope.telemetry.upgrade import upgrade
from tests.telemetry.test_packed_oracles import V5, record_random_events
from tests.telemetry.test_request_sums import drop_request_sums

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module", params=SEEDS)
def recorded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("summaries") / f"random-{request.param}.db"
    record_random_events(path, request.param)
    return path


def from_events(capture: Capture) -> tuple[dict[str, int], list[str]]:
    """The run's events per kind and its match events' principals, from every event."""
    events = capture.events(1, limit=None, columns=["kind", "principal"])
    matches = events[events.kind == "match"].principal.dropna()
    return dict(Counter(str(k) for k in events.kind)), sorted({str(p) for p in matches})


def stored_summaries(path: Path) -> list[tuple[int, str | None, str | None]]:
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT chunk, kind_counts, groups FROM event_chunks ORDER BY chunk").fetchall()


def forget_summaries(path: Path, every: int) -> None:
    """Make every `every`-th chunk look written before version 10 (its summaries NULL)."""
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE event_chunks SET kind_counts = NULL, groups = NULL WHERE chunk % ? = 0", (every,))


ALTERED = {
    "reuse": [["zed", "match", 5]],
    "evictions": [["lru", "full", 2, 7, 3, 4]],
    "stops": [["tail", 1, 5, 6]],
}


def reads(path: Path) -> tuple[dict[str, int], list[str], list[str]]:
    capture = Capture(path)
    try:
        counts = dict(zip(capture.event_counts(1).kind, capture.event_counts(1)["count"], strict=True))
        principals = sorted(match_principals(capture, 1))
        return counts, principals, sharing.run_principals(capture, 1)
    finally:
        capture.close()


def groups_of(events: pd.DataFrame) -> dict[str, list[list[Any]]]:
    """packed.summaries' groups, computed from events with pandas (None for NULL)."""

    def rows(frame: pd.DataFrame, keys: list[str], **sums: tuple[str, str]) -> list[list[Any]]:
        if frame.empty:
            return []
        table = frame.groupby(keys, dropna=False, sort=False).agg(**sums).reset_index()
        out = [[None if v is None or v != v else v for v in row] for row in table.itertuples(index=False)]
        return [[*r[: len(keys)], *(int(v) for v in r[len(keys) :])] for r in out]

    reuse = events[events.kind.isin(["match", "cross_hit"])]
    evicts = events[events.kind == "evict"]
    named = events[(events.kind == "match") & events.reason.notna()]
    return {
        "reuse": rows(reuse, ["principal", "kind"], tokens=("num_tokens", "sum")),
        "evictions": rows(
            evicts,
            ["reason", "pool"],
            n=("seq", "size"),
            tokens=("num_tokens", "sum"),
            first=("step", "min"),
            last=("step", "max"),
        ),
        "stops": rows(named, ["reason"], n=("seq", "size"), hit=("num_tokens", "sum"), missed=("aux", "sum")),
    }


def key_sorted(groups: dict[str, list[list[Any]]]) -> dict[str, list[list[Any]]]:
    return {name: sorted(rows, key=lambda r: [str(v) for v in r]) for name, rows in groups.items()}


def test_each_chunk_stores_its_own_kinds_and_groups(recorded: Path) -> None:
    capture = Capture(recorded)
    try:
        chunks = capture.packed.chunks(1)
        assert len(chunks) > 3  # NOTE: flushed at random: many chunks
        every = capture.events(
            1, limit=None, columns=["step", "kind", "pool", "reason", "principal", "num_tokens", "aux"]
        )
        for (number, counts, groups), chunk in zip(
            stored_summaries(recorded), chunks.itertuples(index=False), strict=True
        ):
            events = every.iloc[int(chunk.first_seq) : int(chunk.first_seq) + int(chunk.num_events)]
            assert json.loads(counts) == dict(Counter(str(k) for k in events.kind)), number
            assert key_sorted(json.loads(groups)) == key_sorted(groups_of(events)), number
        assert any(json.loads(g)["evictions"] for _, _, g in stored_summaries(recorded))
        assert any(json.loads(g)["reuse"] for _, _, g in stored_summaries(recorded))
    finally:
        capture.close()


def test_counts_and_principals_equal_what_the_events_give(recorded: Path) -> None:
    capture = Capture(recorded)
    try:
        kinds, principals = from_events(capture)
        requests = {str(p) for p in capture.requests(1).principal.dropna()}
    finally:
        capture.close()
    counts, match_principals, run_principals = reads(recorded)
    assert counts == kinds
    assert match_principals == principals
    assert run_principals == sorted(set(principals) | requests)


def test_chunks_without_summaries_read_the_same_and_upgrade_stores_theirs(recorded: Path, tmp_path: Path) -> None:
    older = tmp_path / "older.db"
    shutil.copy(recorded, older)
    forget_summaries(older, every=2)
    assert any(counts is None for _, counts, _ in stored_summaries(older))
    assert reads(older) == reads(recorded)
    assert main(["upgrade", str(older)]) == 0
    assert stored_summaries(older) == stored_summaries(recorded)
    assert reads(older) == reads(recorded)


def test_the_reads_come_from_the_stored_summaries(recorded: Path, tmp_path: Path) -> None:
    """A summary is what the reads take (not the events): one altered by hand shows. The run's fold of its
    summaries (version 14, test_run_summaries.py) goes, so they are read chunk by chunk."""
    altered = tmp_path / "altered.db"
    shutil.copy(recorded, altered)
    with sqlite3.connect(altered) as conn:
        conn.execute("DELETE FROM run_summaries")
        conn.execute(
            f"UPDATE event_chunks SET kind_counts = '{{\"match\": 1000000}}', groups = '{json.dumps(ALTERED)}'"
        )
    num_chunks = len(stored_summaries(altered))
    counts, match_principals, run_principals = reads(altered)
    assert counts == {"match": 1000000 * num_chunks}
    assert match_principals == ["zed"] and "zed" in run_principals
    capture = Capture(altered)
    try:
        summary = derived.eviction_summary(capture, 1)
        assert summary.values.tolist() == [["lru", "full", 2 * num_chunks, 7 * num_chunks, 3, 4]]
        assert derived.lookup_stops(capture, 1).values.tolist() == [
            ["tail", num_chunks, 5 * num_chunks, 6 * num_chunks]
        ]
        reuse = sharing.reuse_by_principal(capture, 1)
        assert reuse.values.tolist() == [["zed", 5 * num_chunks, 0]]
    finally:
        capture.close()


def test_a_summary_that_is_not_json_is_one_damaged_capture_line(recorded: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.db"
    shutil.copy(recorded, damaged)
    with sqlite3.connect(damaged) as conn:
        conn.execute("UPDATE event_chunks SET groups = 'not json' WHERE chunk = 1")
        conn.execute("DELETE FROM run_summaries")  # NOTE: read chunk by chunk (test_run_summaries: a damaged fold)
    capture = Capture(damaged)
    try:
        with pytest.raises(Exception, match=r"damaged capture .*event chunk 1's summaries"):
            match_principals(capture, 1)
    finally:
        capture.close()


def test_an_older_file_upgraded_gets_summaries_and_the_principal_index(tmp_path: Path, capsys) -> None:
    path = tmp_path / "v5.db"
    shutil.copy(V5[0], path)
    before = reads(path)
    assert upgrade(path)
    assert all(counts is not None and groups is not None for _, counts, groups in stored_summaries(path))
    with sqlite3.connect(path) as conn:
        indexes = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert schema.ix_requests_principal.name in indexes
    assert reads(path) == before


def test_a_version_9_file_with_chunks_upgrades_with_progress(recorded: Path, tmp_path: Path, capsys) -> None:
    """A file of version 9 (its chunks have no summary columns) gets them, and the index, from
    `kvscope upgrade`, which says how far it is and what it did."""
    older = tmp_path / "v9.db"
    shutil.copy(recorded, older)
    with sqlite3.connect(older) as conn:
        conn.execute("DROP INDEX ix_requests_principal")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN kind_counts")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN groups")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN evict_steps")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN lock_carry")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN request_carry")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN miss_nodes")
        drop_request_sums(conn)
        conn.execute("UPDATE kvscope_meta SET value = '9' WHERE key = 'schema_version'")
    before = reads(older)
    seen: list[tuple[int, int, int]] = []
    done = upgrade(older, summarizing=lambda run, num_done, total: seen.append((run, num_done, total)))
    assert [(r.run_id, r.events, r.summarized) for r in done] == [(1, 0, len(stored_summaries(recorded)))]
    assert seen[-1] == (1, len(stored_summaries(recorded)), len(stored_summaries(recorded)))
    assert stored_summaries(older) == stored_summaries(recorded)
    assert reads(older) == before
    assert main(["upgrade", str(older)]) == 0
    assert capsys.readouterr().out.endswith("nothing to upgrade (every run is packed already)\n")


TEXTS = ["match", "evict", "cross_hit", "alloc", "p0", "p1", "lru"]  # NOTE: one run dictionary: kinds and names


@settings(deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), *(st.sampled_from([NO_CODE, 4, 5, 6]),) * 3, st.integers(0, 9)), max_size=60),
)
def test_summaries_group_the_events_of_one_chunk(events: list[tuple[int, int, int, int, int]]) -> None:
    """Against pandas' groupby (groups_of) on the decoded events: principal, reason and pool NULL or not."""
    kind, pool, reason, principal, value = (
        (np.asarray(column, np.int64) for column in zip(*events, strict=True))
        if events
        else [np.zeros(0, np.int64)] * 5
    )
    columns = {
        "kind": kind,
        "pool": pool,
        "reason": reason,
        "principal": principal,
        "step": value,
        "num_tokens": 2 * value,
        "aux": value + 1,
    }
    present = {TEXTS[k] for k in kind.tolist()}

    def code_of(text: str) -> int | None:
        return TEXTS.index(text) if text in present else None

    def decode(codes: np.ndarray) -> list[str]:
        return [TEXTS[c] for c in codes.tolist()]

    kind_counts, groups = summaries(columns, code_of, decode)
    frame = pd.DataFrame(
        {
            name: [None if c == NO_CODE else TEXTS[c] for c in columns[name].tolist()]
            for name in ("kind", "pool", "reason", "principal")
        }
        | {"step": value, "num_tokens": 2 * value, "aux": value + 1, "seq": np.arange(len(value))},
        columns=["kind", "pool", "reason", "principal", "step", "num_tokens", "aux", "seq"],
    )
    assert json.loads(kind_counts) == dict(Counter(frame.kind))
    assert key_sorted(json.loads(groups)) == key_sorted(groups_of(frame))


def record_bounded(path: Path) -> None:
    """12 steps of a match and an eviction each, a chunk per step, under a 0.2 s window: retention
    drops the oldest chunks as the run goes."""
    with SQLRecorder(path, retention=Retention(keep_events_s=0.2)) as recorder:
        for step in range(12):
            recorder.step = step
            recorder.record(EventKind.MATCH, rid=f"r{step}", num_tokens=step, principal=f"u{step}")
            recorder.record(
                EventKind.EVICT, pool=PoolName.FULL, node_id=step, num_tokens=4, reason=EvictReason.CAPACITY
            )
            recorder.flush()
            time.sleep(0.05)


def test_a_bounded_run_sums_the_events_it_kept(tmp_path: Path) -> None:
    """Retention drops a chunk's summaries with it: the sums describe the kept events, as reading them would."""
    path = tmp_path / "bounded.db"
    record_bounded(path)
    capture = Capture(path)
    try:
        kept = capture.events(1, limit=None, columns=["step", "kind", "principal"])
        assert kept.step.min() > 0 and len(kept)  # NOTE: some chunks were dropped, some kept
        assert dict(zip(capture.event_counts(1).kind, capture.event_counts(1)["count"], strict=True)) == dict(
            Counter(kept.kind)
        )
        assert match_principals(capture, 1) == set(kept.principal.dropna())
        summary = derived.eviction_summary(capture, 1)
        assert summary.values.tolist() == [
            ["capacity", "full", len(kept) // 2, 4 * (len(kept) // 2), kept.step.min(), 11]
        ]
    finally:
        capture.close()
