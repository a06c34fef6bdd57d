"""Request sums (schema version 12): the totals and latency histograms the writer keeps as it writes a
run's request rows, so the Requests page reads a few hundred rows at 100 M events. On random recordings
(several batches, so stored sums are added to), the totals equal those of every request row, per status
and for any set of principals (a tenant's), and each percentile read from the histograms is within
MAX_RELATIVE_ERROR of np.percentile over the exact latencies (max and count exact); a version-11 file
reads its rows until `kvscope upgrade` stores its sums, then reads the same from them."""

from __future__ import annotations

import math
import random
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.app import main
from kvscope.dashboard import timing
from kvscope.telemetry import MAX_RELATIVE_ERROR, REQUEST_LATENCIES, Histogram, schema, tenant_of
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.records import RequestRecord
from kvscope.telemetry.request_sums import FLOOR_MS, sums_rows
from kvscope.telemetry.upgrade import upgrade

STATUSES = ("finished", "aborted", "unfinished", "retracted")
PRINCIPALS = (None, "t1:alice", "t1:bob", "t2:carol", "dave")
MOMENTS = ("arrive", "admit", "first_token", "finish")
TOTAL_COLUMNS = ("num_requests", "prompt_tokens", "cached_tokens", "retractions")


def random_requests(seed: int, num_requests: int) -> list[RequestRecord]:
    """Requests of random principals and statuses; some miss moments, some end before they start, some
    share a latency (ties), latencies from 0 to minutes."""
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        t = rng.uniform(0, 1000)
        times: dict[str, float] = {"arrive": t}
        for moment in MOMENTS[1:]:
            if rng.random() < 0.15:
                continue
            gap = rng.choice((0.0, 1e-7, 0.25, 10 ** rng.uniform(-6, 2), -rng.random()))
            times[moment] = t + gap
        if rng.random() < 0.05:
            del times["arrive"]
        out.append(
            RequestRecord(
                f"r{i:05d}",
                rng.choice(PRINCIPALS),
                rng.randint(1, 500),
                rng.choice(STATUSES),
                rng.randint(0, 100),
                rng.randint(0, 50),
                rng.randint(0, 3),
                times,
                {"arrive": i},
            )
        )
    return out


def record(path: Path | str, requests: Sequence[RequestRecord], seed: int) -> None:
    """Into a new run, handed to the writer in random batches (so stored sums are added to)."""
    rng = random.Random(seed)
    with SQLRecorder(path, level="summary", label="request-sums") as rec:
        for request in requests:
            rec.request(request)
            if rng.random() < 0.1:
                rec.idle()


def totals_of_rows(every: pd.DataFrame, principals: Sequence[str] | None) -> pd.DataFrame:
    rows = every if principals is None else every[every["principal"].isin(principals)]
    return (
        rows.groupby("status", sort=True)
        .agg(
            num_requests=("rid", "size"),
            prompt_tokens=("prompt_len", "sum"),
            cached_tokens=("cached_tokens", "sum"),
            retractions=("num_retractions", "sum"),
        )
        .reset_index()
    )


def tenants(every: pd.DataFrame) -> list[list[str] | None]:
    """None (every request) and each tenant's principals, as the dashboard's tenant filter picks them."""
    named = sorted({str(p) for p in every["principal"].dropna()})
    by_tenant = {tenant_of(p) for p in named}
    return [None, *([p for p in named if tenant_of(p) == t] for t in sorted(by_tenant, key=str)), ["nobody"]]


def assert_totals_equal(capture: Capture, run_id: int) -> None:
    every = capture.requests(run_id)
    for principals in tenants(every):
        expected = totals_of_rows(every, principals)
        totals = capture.request_totals(run_id, principals)
        assert totals["status"].tolist() == expected["status"].tolist(), principals
        for column in TOTAL_COLUMNS:
            assert totals[column].astype(int).tolist() == expected[column].astype(int).tolist(), column


def exact_latencies(every: pd.DataFrame) -> dict[str, np.ndarray]:
    """Each latency in ms as the page's exact read gives it (timing.latencies)."""
    latency_ms = timing.latencies(every)
    return {name: latency_ms[name].dropna().to_numpy(dtype=float) for name in REQUEST_LATENCIES}


def assert_close(estimate: float, exact: float, what: str) -> None:
    bound = MAX_RELATIVE_ERROR * abs(exact) + FLOOR_MS + 1e-9 * abs(exact)
    assert abs(estimate - exact) <= bound, f"{what}: {estimate} vs {exact} (bound {bound})"


def assert_percentiles_close(histograms: pd.DataFrame, every: pd.DataFrame) -> None:
    table = timing.histogram_percentiles(histograms).set_index("latency")
    for name, values in exact_latencies(every).items():
        row = table.loc[name]
        assert int(row["requests"]) == len(values), name
        if not len(values):
            assert math.isnan(row["p50 (ms)"])
            continue
        assert row["max (ms)"] == values.max(), name  # NOTE: exact: the top bucket's greatest value
        for q in (*timing.PERCENTILES, 25, 75):
            column = f"p{q} (ms)" if q in timing.PERCENTILES else ("q1" if q == 25 else "q3")
            assert_close(float(row[column]), float(np.percentile(values, q)), f"{name} p{q}")
        assert row["q1"] <= row["median"] <= row["q3"], name
        # NOTE: a whisker is a value within 1.5 IQR of the box: between two far values it can lie inside the box
        assert values.min() <= row["low"] <= values.max() and values.min() <= row["high"] <= values.max(), name


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), num_requests=st.integers(0, 400))
def test_sums_equal_every_request_row(tmp_path: Path, seed: int, num_requests: int) -> None:
    path = tmp_path / f"sums-{seed}-{num_requests}.db"
    path.unlink(missing_ok=True)
    record(path, random_requests(seed, num_requests), seed)
    capture = Capture(path)
    try:
        assert capture.has_request_sums(1)
        assert_totals_equal(capture, 1)
        every = capture.requests(1)
        for principals in tenants(every):
            histograms = capture.request_latency_histograms(1, principals)
            assert histograms is not None
            chosen = every if principals is None else every[every["principal"].isin(principals)]
            assert_percentiles_close(histograms, chosen)
    finally:
        capture.close()


SPREAD = st.lists(st.one_of(st.just(0.0), st.floats(0, 1e-3), st.floats(1e-3, 1e7)), min_size=1, max_size=300)
# NOTE: many values within one bucket's width of each other: most order statistics are read as a middle
CROWDED = st.builds(
    lambda base, factors: [base * f for f in factors],
    st.floats(1e-3, 1e6),
    st.lists(st.floats(1.0, 1.011), min_size=3, max_size=300),
)


@settings(max_examples=300, deadline=None)
@given(values=st.one_of(SPREAD, CROWDED), batches=st.integers(1, 5))
def test_percentiles_of_the_buckets_are_within_half_a_bucket(values: list[float], batches: int) -> None:
    """The histogram of latencies summed over batches (as the writer adds them) against np.percentile."""
    columns = ("principal", "status", "prompt_len", "cached_tokens", "num_retractions", *timing.REQUEST_TIMES)
    rows = [("p", "finished", 1, 0, 0, 0.0, None, None, ms / 1000.0) for ms in values]
    merged: dict[int, list[float]] = {}
    for part in np.array_split(np.arange(len(rows)), batches):
        _, latencies = sums_rows(1, columns, [rows[i] for i in part])
        for _, _, name, bucket, n, least, most in latencies:
            if name == "end to end":
                old = merged.get(bucket, [0, math.inf, -math.inf])
                merged[bucket] = [old[0] + n, min(old[1], least), max(old[2], most)]
    buckets = np.array(sorted(merged))
    hist = Histogram(buckets, *(np.array([merged[b][i] for b in buckets]) for i in range(3)))
    exact = np.array([(ms / 1000.0 - 0.0) * 1000.0 for ms in values])  # NOTE: as the writer computes it
    assert hist.num_values == len(values)
    for q in (0, 1, 25, 50, 75, 90, 99, 100):
        assert_close(hist.percentile(q), float(np.percentile(exact, q)), f"p{q}")
    assert hist.percentile(100) == exact.max() and hist.percentile(0) == exact.min()


def drop_request_sums(conn: sqlite3.Connection) -> None:
    """What version 12 added: the request sums' tables and runs.request_sums."""
    for table in schema.REQUEST_SUM_TABLES:
        conn.execute(f"DROP TABLE {table.name}")
    conn.execute("ALTER TABLE runs DROP COLUMN request_sums")


def drop_version_13(conn: sqlite3.Connection) -> None:
    """What version 13 added: event_chunks.miss_nodes and the index ix_requests_arrive_t."""
    conn.execute("ALTER TABLE event_chunks DROP COLUMN miss_nodes")
    conn.execute("DROP INDEX ix_requests_arrive_t")


def as_version_11(path: Path) -> None:
    """What a version-11 writer leaves: no request sums, no runs.request_sums, no miss_nodes, version 11."""
    with sqlite3.connect(path) as conn:
        drop_version_13(conn)
        drop_request_sums(conn)
        conn.execute("UPDATE kvscope_meta SET value = '11' WHERE key = 'schema_version'")


def test_a_version_11_file_reads_its_rows_and_upgrade_stores_its_sums(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "v11.db"
    record(path, random_requests(3, 500), 3)
    record(path, random_requests(4, 300), 4)  # NOTE: a second run, summed apart from the first
    as_version_11(path)
    before = Capture(path)
    try:
        assert not before.has_request_sums(1) and before.request_latency_histograms(1) is None
        assert_totals_equal(before, 1)  # NOTE: from the request rows
        wanted = {run: before.request_totals(run) for run in (1, 2)}
    finally:
        before.close()
    assert main(["upgrade", str(path)]) == 0
    out = capsys.readouterr().out
    assert "run 1: sums of 500 request(s) stored" in out and "run 2: sums of 300 request(s) stored" in out
    after = Capture(path)
    try:
        assert after.schema_version == schema.SCHEMA_VERSION
        for run in (1, 2):
            assert after.has_request_sums(run)
            pd.testing.assert_frame_equal(after.request_totals(run), wanted[run])
            assert_totals_equal(after, run)
            every = after.requests(run)
            for principals in tenants(every):
                chosen = every if principals is None else every[every["principal"].isin(principals)]
                histograms = after.request_latency_histograms(run, principals)
                assert histograms is not None
                assert_percentiles_close(histograms, chosen)
    finally:
        after.close()
    assert upgrade(path) == []  # NOTE: nothing left to do


def test_a_run_written_into_an_upgraded_file_is_summed_by_its_writer(tmp_path: Path) -> None:
    """A version-12 writer opening a version-11 file: its own run is summed, the older one read from rows."""
    path = tmp_path / "mixed.db"
    record(path, random_requests(5, 200), 5)
    as_version_11(path)
    record(path, random_requests(6, 200), 6)
    capture = Capture(path)
    try:
        assert not capture.has_request_sums(1) and capture.has_request_sums(2)
        assert_totals_equal(capture, 1)
        assert_totals_equal(capture, 2)
    finally:
        capture.close()


def test_the_totals_come_from_the_sums(tmp_path: Path) -> None:
    """A changed stored sum shows in the totals read (they are not read from the rows)."""
    path = tmp_path / "sums.db"
    record(path, random_requests(8, 100), 8)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE request_sums SET num_requests = num_requests + 1000")
    capture = Capture(path)
    try:
        stored = int(capture.request_totals(1)["num_requests"].sum())
        assert stored == 100 + 1000 * len(capture.read_frame(schema.request_sums.select()))
    finally:
        capture.close()
