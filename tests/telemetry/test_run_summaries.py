"""A run's chunk summaries folded into one row (schema version 14, run_summaries): the writer folds each
chunk's kind counts and groups into it in the transaction that writes the chunk, so the event counts,
principals, reuse, eviction summary and lookup stops read one row (and the chunks after it), not every
chunk. Every read must give what the chunk-by-chunk read gives: on random recordings (many chunks), a live
run read between flushes, a fold that stops short of the run's last chunks, a run whose retention drop
ended its fold, a version-13 file (no such table) before and after `kvscope upgrade`."""

from __future__ import annotations

import shutil
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvscope.app import main
from kvscope.telemetry import derived, schema, sharing
from kvscope.telemetry.event_source import match_principals
from kvscope.telemetry.events import EventKind, EvictReason, PoolName
from kvscope.telemetry.packed import GROUP_FOLDS, SummaryFold
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.upgrade import upgrade
from tests.telemetry.test_chunk_summaries import record_bounded
from tests.telemetry.test_packed_oracles import record_random_events


def reads(capture: Capture, run_id: int = 1) -> dict[str, Any]:
    """Every read the fold serves, as its callers give it."""
    counts = capture.event_counts(run_id)
    return {
        "counts": dict(zip(counts.kind, counts["count"], strict=True)),
        "principals": sorted(match_principals(capture, run_id)),
        "run_principals": sharing.run_principals(capture, run_id),
        "reuse": sharing.reuse_by_principal(capture, run_id).values.tolist(),
        "evictions": derived.eviction_summary(capture, run_id).values.tolist(),
        "stops": derived.lookup_stops(capture, run_id).values.tolist(),
    }


def chunk_by_chunk(capture: Capture, run_id: int = 1, through_chunk: int | None = None) -> SummaryFold:
    """The fold of every chunk's own summaries (the read before version 14), up to `through_chunk`."""
    fold = SummaryFold()
    for chunk in capture.packed.summaries(run_id, capture.schema_version).itertuples(index=False):
        if through_chunk is None or int(chunk.chunk) <= through_chunk:
            per_kind, groups = capture.packed.chunk_summaries(run_id, chunk)
            fold.add(int(chunk.chunk), int(chunk.num_events), per_kind, groups)
    return fold


def read_through_fold(capture: Capture, run_id: int = 1) -> SummaryFold:
    """What each_summary gives (the stored fold, then the chunks after it), folded."""
    fold = SummaryFold()
    for per_kind, groups in capture.packed.each_summary(run_id, capture.schema_version):
        fold.add(0, 0, per_kind, groups)
    return fold


def same(a: SummaryFold, b: SummaryFold) -> bool:
    return a.kind_counts == b.kind_counts and all(a.groups[n] == b.groups[n] for n in GROUP_FOLDS)


def stored_fold(path: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(f"SELECT {', '.join(schema.RUN_SUMMARY_COLUMNS)} FROM run_summaries").fetchall()


def without_fold(path: Path, copy: Path) -> Path:
    """A copy of the capture whose runs have no fold: its readers read chunk by chunk."""
    shutil.copy(path, copy)
    with sqlite3.connect(copy) as conn:
        conn.execute("DELETE FROM run_summaries")
    return copy


def open_reads(path: Path) -> dict[str, Any]:
    capture = Capture(path)
    try:
        return reads(capture)
    finally:
        capture.close()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), num_steps=st.integers(1, 90))
@example(seed=335, num_steps=1)  # NOTE: a run whose one step drew no event: no chunk, so no fold row
def test_the_fold_reads_what_every_chunk_reads(tmp_path: Path, seed: int, num_steps: int) -> None:
    path = tmp_path / f"random-{seed}-{num_steps}.db"
    path.unlink(missing_ok=True)
    record_random_events(path, seed, num_steps)
    capture = Capture(path)
    try:
        chunks = capture.packed.chunks(1)
        rows = stored_fold(path)
        if chunks.empty:
            assert rows == []
        else:
            (row,) = rows
            assert row[:4] == (1, int(chunks.chunk.max()), len(chunks), int(chunks.num_events.sum()))
        assert same(read_through_fold(capture), chunk_by_chunk(capture))
        events = capture.events(1, limit=None, columns=["kind"])
        assert capture.packed.kind_counts(1, capture.schema_version) == dict(Counter(events.kind))
        folded = reads(capture)
    finally:
        capture.close()
    assert folded == open_reads(without_fold(path, tmp_path / "unfolded.db"))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("folds") / "random.db"
    record_random_events(path, 7, num_steps=150)
    return path


def test_a_fold_short_of_the_last_chunks_reads_them_after_it(recorded: Path, tmp_path: Path) -> None:
    """A fold of the first chunks only (a reader between a writer's commits sees the fold and the chunks of
    one commit; this is the reader's side of it): the chunks after through_chunk are read one by one."""
    path = tmp_path / "short.db"
    shutil.copy(recorded, path)
    capture = Capture(path)
    try:
        num_chunks = len(capture.packed.chunks(1))
        assert num_chunks > 6
        whole = reads(capture)
        short = chunk_by_chunk(capture, through_chunk=num_chunks // 2)
    finally:
        capture.close()
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM run_summaries")
        conn.execute(
            f"INSERT INTO run_summaries VALUES ({', '.join('?' * len(schema.RUN_SUMMARY_COLUMNS))})", short.row(1)
        )
    capture = Capture(path)
    try:
        with capture.engine.connect() as conn:
            assert capture.packed.fold(1, capture.schema_version, conn) is not None
        assert reads(capture) == whole
        assert same(read_through_fold(capture), chunk_by_chunk(capture))
    finally:
        capture.close()


def test_the_reads_come_from_the_fold(recorded: Path, tmp_path: Path) -> None:
    """The stored fold is what the reads take (not the chunks' own summaries): one altered by hand shows."""
    path = tmp_path / "altered.db"
    shutil.copy(recorded, path)
    altered = SummaryFold()
    groups = {"reuse": [["zed", "match", 5]], "evictions": [["lru", "full", 2, 7, 3, 4]], "stops": [["tail", 1, 5, 6]]}
    altered.add(0, 0, {"match": 1_000_000}, groups)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE run_summaries SET kind_counts = ?, groups = ?", (altered.row(1)[4], altered.row(1)[5]))
    got = open_reads(path)
    assert got["counts"] == {"match": 1_000_000}
    assert got["principals"] == ["zed"] and got["evictions"] == [["lru", "full", 2, 7, 3, 4]]
    assert got["stops"] == [["tail", 1, 5, 6]] and got["reuse"] == [["zed", 5, 0]]


def test_a_fold_that_no_longer_counts_the_chunks_is_not_read(recorded: Path, tmp_path: Path) -> None:
    """A fold whose chunks up to through_chunk are not the ones it counts (chunks gone since: retention) is
    passed over for the chunk-by-chunk read, whatever it holds."""
    path = tmp_path / "stale.db"
    shutil.copy(recorded, path)
    whole = open_reads(path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE run_summaries SET kind_counts = '{\"match\": 1000000}', num_events = num_events + 1")
    assert open_reads(path) == whole


def test_a_fold_that_is_not_json_is_one_damaged_capture_line(recorded: Path, tmp_path: Path) -> None:
    path = tmp_path / "damaged.db"
    shutil.copy(recorded, path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE run_summaries SET groups = 'not json'")
    capture = Capture(path)
    try:
        with pytest.raises(Exception, match=r"damaged capture .*folded summaries"):
            match_principals(capture, 1)
    finally:
        capture.close()


def test_a_live_run_reads_its_fold_between_flushes(tmp_path: Path) -> None:
    """While the run is written: after each flush the fold covers every chunk written, in the same commit."""
    path = tmp_path / "live.db"
    with SQLRecorder(path, level="full") as recorder:
        for step in range(6):
            recorder.step = step
            recorder.record(EventKind.MATCH, rid=f"r{step}", num_tokens=step, aux=1, principal=f"u{step % 3}")
            recorder.record(
                EventKind.EVICT, pool=PoolName.FULL, node_id=step, num_tokens=2, reason=EvictReason.CAPACITY
            )
            recorder.flush()
            capture = Capture(path)
            try:
                (row,) = stored_fold(path)
                assert row[1:4] == (step, step + 1, 2 * (step + 1))
                assert same(read_through_fold(capture), chunk_by_chunk(capture))
                assert reads(capture)["evictions"] == [["capacity", "full", step + 1, 2 * (step + 1), 0, step]]
            finally:
                capture.close()


def test_a_retention_drop_ends_the_fold_and_the_reads_describe_the_kept_events(tmp_path: Path) -> None:
    """Retention drops whole chunks, which a fold cannot take out (the least step of an eviction): the
    writer stores the empty fold after its first drop, and the reads are those of the kept chunks."""
    path = tmp_path / "bounded.db"
    record_bounded(path)
    assert stored_fold(path) == [(1, -1, 0, 0, "{}", '{"evictions": [], "reuse": [], "stops": []}')]
    capture = Capture(path)
    try:
        kept = capture.events(1, limit=None, columns=["step", "kind", "principal"])
        assert kept.step.min() > 0
        got = reads(capture)
        assert got["counts"] == dict(Counter(kept.kind))
        assert got["evictions"] == [["capacity", "full", len(kept) // 2, 4 * (len(kept) // 2), kept.step.min(), 11]]
    finally:
        capture.close()
    assert upgrade(path)[0].folded == len(kept) // 2  # NOTE: the ended run's kept chunks, folded once more
    assert stored_fold(path)[0][1:4] == (11, len(kept) // 2, len(kept))
    assert open_reads(path) == got


def as_version_13(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE run_summaries")
        conn.execute("UPDATE kvscope_meta SET value = '13' WHERE key = 'schema_version'")


def test_a_version_13_file_reads_chunk_by_chunk_and_upgrade_folds_it(
    recorded: Path, tmp_path: Path, capsys: Any
) -> None:
    path = tmp_path / "v13.db"
    shutil.copy(recorded, path)
    whole = open_reads(recorded)
    with SQLRecorder(path, level="full") as recorder:  # NOTE: a second run, folded apart from the first
        recorder.record(EventKind.MATCH, rid="x", num_tokens=3, principal="solo")
    as_version_13(path)
    capture = Capture(path)
    try:
        assert capture.schema_version == 13
        assert reads(capture) == whole
    finally:
        capture.close()
    assert main(["upgrade", str(path)]) == 0
    out = capsys.readouterr().out
    assert "run 1: summaries of" in out and "folded into one row" in out
    assert [row[0] for row in stored_fold(path)] == [1, 2]
    assert stored_fold(path)[0] == stored_fold(recorded)[0]  # NOTE: the writer's fold and upgrade's are one
    assert open_reads(path) == whole
    assert main(["upgrade", str(path)]) == 0
    assert capsys.readouterr().out.endswith("nothing to upgrade (every run is packed already)\n")


def test_a_fold_of_many_keys_is_stored_every_few_chunks_and_when_the_run_closes(tmp_path: Path) -> None:
    """700 principals (700 reuse rows, more than FOLD_ROWS_PER_CHUNK): the writer stores the fold every second
    chunk, so a reader between reads the chunk after it too, and the closing batch stores the rest."""
    path = tmp_path / "many.db"
    assert 512 < 700 <= 2 * 512  # NOTE: writer.FOLD_ROWS_PER_CHUNK: stored every second chunk
    stored: list[int | None] = []
    with SQLRecorder(path, level="full") as recorder:
        for step in range(7):  # NOTE: one chunk a flush
            recorder.step = step
            for i in range(700):
                recorder.record(EventKind.MATCH, rid=f"r{i}", num_tokens=step + i % 3, principal=f"u{i}")
            recorder.flush()
            fold = stored_fold(path)
            stored.append(fold[0][1] if fold else None)
            capture = Capture(path)
            try:
                assert len(capture.packed.chunks(1)) == step + 1
                assert same(read_through_fold(capture), chunk_by_chunk(capture))
            finally:
                capture.close()
    assert stored == [None, 1, 1, 3, 3, 5, 5]
    assert stored_fold(path)[0][1:4] == (6, 7, 7 * 700)  # NOTE: the closing batch stored the last chunk's
