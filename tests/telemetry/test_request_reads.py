"""The Requests page's reads by page and by aggregate (Capture.request_rows, request_totals,
request_principals, first_arrival) equal the same answers computed from every request row
(Capture.requests, the read they replace on that page), on a real capture."""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd
import pytest

from kvscope.telemetry import Capture, SQLRecorder
from kvscope.telemetry.records import RequestRecord

STATUSES = ("finished", "aborted", "retracted", "running")
PRINCIPALS = (None, "t1:alice", "t1:bob", "t2:carol", "dave")


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Capture:
    path = Path(tmp_path_factory.mktemp("requests")) / "requests.db"
    rng = random.Random(7)
    with SQLRecorder(path, level="summary", label="request-reads") as rec:
        for i in range(300):
            arrive_step = rng.randrange(50)
            arrive_t = 100.0 + arrive_step * 0.01 + rng.random() * 0.001
            rec.request(
                RequestRecord(
                    f"r{rng.randrange(10_000):05d}-{i}",
                    rng.choice(PRINCIPALS),
                    rng.randint(1, 500),
                    rng.choice(STATUSES),
                    rng.randint(0, 100),
                    rng.randint(0, 50),
                    rng.randint(0, 2),
                    {"arrive": arrive_t, "finish": arrive_t + rng.random()},
                    {"arrive": arrive_step},
                )
            )
    return Capture(path)


def test_pages_of_rows_equal_slices_of_every_row(capture: Capture) -> None:
    every = capture.requests(1)
    assert len(every) == 300
    for principals in (None, ["t1:alice", "t1:bob"], ["nobody"]):
        for statuses in (None, ["finished"], ["aborted", "running"]):
            mask = pd.Series(True, index=every.index)
            if principals is not None:
                mask &= every["principal"].isin(principals)
            if statuses is not None:
                mask &= every["status"].isin(statuses)
            expected = every[mask].reset_index(drop=True)
            for limit, offset in ((60, 0), (60, 60), (7, 3), (None, 0)):
                page = capture.request_rows(1, principals=principals, statuses=statuses, limit=limit, offset=offset)
                end = None if limit is None else offset + limit
                want = expected.iloc[offset:end].reset_index(drop=True)
                # NOTE: an empty read has no values to type (object columns, as every empty read)
                pd.testing.assert_frame_equal(page, want, check_dtype=not want.empty, check_index_type=not want.empty)
    one = every.iloc[123]
    found = capture.request_rows(1, rid=one["rid"])
    assert found["rid"].tolist() == [one["rid"]] and found.iloc[0]["prompt_len"] == one["prompt_len"]
    assert capture.request_rows(1, rid="no-such-request").empty


def test_totals_principals_and_first_arrival_equal_every_row(capture: Capture) -> None:
    every = capture.requests(1)
    for principals in (None, ["t1:alice", "dave"]):
        rows = every if principals is None else every[every["principal"].isin(principals)]
        expected = (
            rows.groupby("status", sort=True)
            .agg(
                num_requests=("rid", "size"),
                prompt_tokens=("prompt_len", "sum"),
                cached_tokens=("cached_tokens", "sum"),
                retractions=("num_retractions", "sum"),
            )
            .reset_index()
        )
        totals = capture.request_totals(1, principals)
        assert totals["status"].tolist() == expected["status"].tolist()
        for column in ("num_requests", "prompt_tokens", "cached_tokens", "retractions"):
            assert totals[column].astype(int).tolist() == expected[column].astype(int).tolist(), column
    assert capture.request_principals(1) == sorted(p for p in set(every["principal"]) if isinstance(p, str))
    assert capture.first_arrival(1) == every["arrive_t"].min()
    assert capture.first_arrival(2) is None  # no such run: no requests
