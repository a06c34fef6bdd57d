"""Request sums (schema version 12) on PostgreSQL (against a real server: `make test-postgres`): writers
add their batches' sums with the server's upserts, two runs recorded at once keep apart, and a version-11
database reads its request rows until `kvscope upgrade` stores its sums; every time the totals equal those
of the request rows and the percentiles are within MAX_RELATIVE_ERROR of the exact ones."""

from __future__ import annotations

import threading

import pytest

from kvscope.telemetry import schema
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.upgrade import upgrade
from tests.telemetry.test_request_sums import (
    assert_percentiles_close,
    assert_totals_equal,
    random_requests,
    record,
    tenants,
)

pytestmark = pytest.mark.postgres
psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL driver (pip install 'kvscope[postgres]')")


def assert_sums_equal_rows(capture: Capture, run_id: int) -> None:
    assert_totals_equal(capture, run_id)
    every = capture.requests(run_id)
    for principals in tenants(every):
        histograms = capture.request_latency_histograms(run_id, principals)
        assert histograms is not None
        chosen = every if principals is None else every[every["principal"].isin(principals)]
        assert_percentiles_close(histograms, chosen)


def test_two_writers_at_once_sum_their_own_runs(postgres_url: str) -> None:
    record(postgres_url, random_requests(1, 10), 1)  # NOTE: the schema first, then two writers together
    writers = [
        threading.Thread(target=record, args=(postgres_url, random_requests(seed, 600), seed)) for seed in (2, 3)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    capture = Capture(postgres_url)
    try:
        assert len(capture.runs()) == 3
        for run_id in (1, 2, 3):
            assert capture.has_request_sums(run_id)
            assert_sums_equal_rows(capture, run_id)
    finally:
        capture.close()


def test_a_version_11_database_is_summed_by_upgrade(postgres_url: str) -> None:
    record(postgres_url, random_requests(4, 500), 4)
    with psycopg.connect(postgres_url) as conn:
        for table in schema.REQUEST_SUM_TABLES:
            conn.execute(f"DROP TABLE {table.name}")
        conn.execute("ALTER TABLE runs DROP COLUMN request_sums")
        conn.execute("ALTER TABLE event_chunks DROP COLUMN miss_nodes")  # NOTE: and version 13's additions
        conn.execute("DROP INDEX ix_requests_arrive_t")
        conn.execute("UPDATE kvscope_meta SET value = '11' WHERE key = 'schema_version'")
    before = Capture(postgres_url)
    try:
        assert not before.has_request_sums(1) and before.request_latency_histograms(1) is None
        assert_totals_equal(before, 1)
    finally:
        before.close()
    seen: list[tuple[int, int, int]] = []
    done = upgrade(postgres_url, summing=lambda run, num_done, total: seen.append((run, num_done, total)))
    assert [(r.run_id, r.requests_summed) for r in done] == [(1, 500)] and seen[-1] == (1, 500, 500)
    after = Capture(postgres_url)
    try:
        assert after.schema_version == schema.SCHEMA_VERSION and after.has_request_sums(1)
        assert_sums_equal_rows(after, 1)
    finally:
        after.close()
