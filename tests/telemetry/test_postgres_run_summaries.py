"""The fold of a run's chunk summaries (schema version 14) on PostgreSQL (against a real server: `make
test-postgres`): the writer's upsert keeps one row a run, two runs recorded at once keep apart, and the reads
through it equal the chunk-by-chunk reads; a version-13 database reads chunk by chunk until `kvscope upgrade`
stores its folds."""

from __future__ import annotations

import threading

import pytest

from kvscope.telemetry import schema
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.upgrade import upgrade
from tests.telemetry.test_packed_oracles import record_random_events
from tests.telemetry.test_run_summaries import chunk_by_chunk, read_through_fold, reads, same

pytestmark = pytest.mark.postgres
psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL driver (pip install 'kvscope[postgres]')")


def folds(url: str) -> list[tuple[int, int, int]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT run_id, num_chunks, num_events FROM run_summaries ORDER BY run_id").fetchall()


def test_two_writers_at_once_fold_their_own_runs(postgres_url: str) -> None:
    record_random_events(postgres_url, 1, num_steps=20)  # NOTE: the schema first, then two writers together
    writers = [threading.Thread(target=record_random_events, args=(postgres_url, seed, 60)) for seed in (2, 3)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    capture = Capture(postgres_url)
    try:
        for run_id, num_chunks, num_events in folds(postgres_url):
            chunks = capture.packed.chunks(run_id)
            assert (num_chunks, num_events) == (len(chunks), int(chunks.num_events.sum()))
            with capture.engine.connect() as conn:
                assert capture.packed.fold(run_id, capture.schema_version, conn) is not None
            assert same(read_through_fold(capture, run_id), chunk_by_chunk(capture, run_id))
        assert [run for run, _, _ in folds(postgres_url)] == [1, 2, 3]
    finally:
        capture.close()


def test_a_version_13_database_is_folded_by_upgrade(postgres_url: str) -> None:
    record_random_events(postgres_url, 4, num_steps=80)
    capture = Capture(postgres_url)
    try:
        whole = reads(capture)
    finally:
        capture.close()
    with psycopg.connect(postgres_url) as conn:
        conn.execute("DROP TABLE run_summaries")
        conn.execute("UPDATE kvscope_meta SET value = '13' WHERE key = 'schema_version'")
    before = Capture(postgres_url)
    try:
        assert before.schema_version == 13 and reads(before) == whole
    finally:
        before.close()
    seen: list[tuple[int, int, int]] = []
    done = upgrade(postgres_url, folding=lambda run, num_done, total: seen.append((run, num_done, total)))
    assert [r.run_id for r in done if r.folded] == [1] and seen[-1][0] == 1 and seen[-1][1] == seen[-1][2]
    after = Capture(postgres_url)
    try:
        assert after.schema_version == schema.SCHEMA_VERSION and reads(after) == whole
        assert same(read_through_fold(after), chunk_by_chunk(after))
    finally:
        after.close()
