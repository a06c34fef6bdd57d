"""Chunk summaries (schema version 10): each chunk's events per kind and its match events' principals,
stored as it is written, so the Overview's event counts and the sidebar's principals read chunk rows
instead of every event. They must give what the events give: on random recordings, against the
events themselves; with some chunks written before version 10 (no summaries); and after `kvscope
upgrade` stored the missing ones."""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvscope.app import main
from kvscope.telemetry import schema, sharing
from kvscope.telemetry.event_source import match_principals
from kvscope.telemetry.packed import NO_CODE, summaries
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.upgrade import upgrade
from tests.telemetry.test_packed_oracles import V5, record_random_events

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
        return conn.execute("SELECT chunk, kind_counts, principals FROM event_chunks ORDER BY chunk").fetchall()


def forget_summaries(path: Path, every: int) -> None:
    """Make every `every`-th chunk look written before version 10 (its summaries NULL)."""
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE event_chunks SET kind_counts = NULL, principals = NULL WHERE chunk % ? = 0", (every,))


def reads(path: Path) -> tuple[dict[str, int], list[str], list[str]]:
    capture = Capture(path)
    try:
        counts = dict(zip(capture.event_counts(1).kind, capture.event_counts(1)["count"], strict=True))
        principals = sorted(match_principals(capture, 1))
        return counts, principals, sharing.run_principals(capture, 1)
    finally:
        capture.close()


def test_each_chunk_stores_its_own_kinds_and_match_principals(recorded: Path) -> None:
    capture = Capture(recorded)
    try:
        chunks = capture.packed.chunks(1)
        assert len(chunks) > 3  # NOTE: flushed at random: many chunks
        for (number, counts, principals), chunk in zip(
            stored_summaries(recorded), chunks.itertuples(index=False), strict=True
        ):
            events = capture.events(
                1, limit=None, columns=["kind", "principal"], step_range=None, rid=None
            ).iloc[int(chunk.first_seq) : int(chunk.first_seq) + int(chunk.num_events)]
            matches = events[events.kind == "match"].principal.dropna()
            assert json.loads(counts) == dict(Counter(str(k) for k in events.kind)), number
            assert json.loads(principals) == sorted({str(p) for p in matches}), number
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
    """A summary is what the reads take (not the events): one altered by hand shows."""
    altered = tmp_path / "altered.db"
    shutil.copy(recorded, altered)
    with sqlite3.connect(altered) as conn:
        conn.execute("""UPDATE event_chunks SET kind_counts = '{"match": 1000000}', principals = '["zed"]'""")
    counts, match_principals, run_principals = reads(altered)
    assert counts == {"match": 1000000 * len(stored_summaries(altered))}
    assert match_principals == ["zed"] and "zed" in run_principals


def test_a_summary_that_is_not_json_is_one_damaged_capture_line(recorded: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.db"
    shutil.copy(recorded, damaged)
    with sqlite3.connect(damaged) as conn:
        conn.execute("UPDATE event_chunks SET principals = 'not json' WHERE chunk = 1")
    capture = Capture(damaged)
    try:
        with pytest.raises(Exception, match=r"damaged capture .*event chunk 1's summaries"):
            capture.packed.match_principals(1, capture.schema_version)
    finally:
        capture.close()


def test_an_older_file_upgraded_gets_summaries_and_the_principal_index(tmp_path: Path, capsys) -> None:
    path = tmp_path / "v5.db"
    shutil.copy(V5[0], path)
    before = reads(path)
    assert upgrade(path)
    assert all(counts is not None and principals is not None for _, counts, principals in stored_summaries(path))
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
        conn.execute("ALTER TABLE event_chunks DROP COLUMN principals")
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


@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(NO_CODE, 4)), max_size=60),
    st.one_of(st.none(), st.integers(0, 4)),
)
def test_summaries_count_every_kind_and_name_each_match_principal_once(
    events: list[tuple[int, int]], match: int | None
) -> None:
    texts = ["a", "b", "match", "d", "e"]
    kind = np.asarray([k for k, _ in events], np.int32)
    principal = np.asarray([p for _, p in events], np.int32)
    counts, principals = summaries(kind, principal, match, lambda codes: [texts[c] for c in codes.tolist()])
    assert json.loads(counts) == dict(Counter(texts[k] for k, _ in events))
    assert json.loads(principals) == sorted({texts[p] for k, p in events if k == match and p != NO_CODE})
