"""Retention on a PostgreSQL capture (`make test-postgres`): the writer's pass bounds the run's own
event bytes (the database is shared), drops its oldest whole chunks with the run's event_retention row
and the strings only they used, and readers read the rest as an undamaged run; `kvscope runs` says what was dropped."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvscope.telemetry import Capture, Retention
from tests.telemetry.test_retention_pass import kept_strings, record

pytestmark = pytest.mark.postgres
pytest.importorskip("psycopg", reason="the PostgreSQL driver (pip install 'kvscope[postgres]')")
BOUND_BYTES = 200_000


def test_a_size_bound_on_postgresql_bounds_the_runs_events(postgres_url: str) -> None:
    run_id = record(postgres_url, Retention(max_bytes=BOUND_BYTES), steps=200)
    capture = Capture(postgres_url)
    try:
        kept = capture.run_retention(run_id)
        assert kept is not None and int(kept.first_seq) > 0 and int(kept.dropped_bytes) > BOUND_BYTES
        assert capture.event_bytes()[run_id] <= BOUND_BYTES
        events = capture.events(run_id, limit=None)
        assert int(events.seq.min()) == int(kept.first_seq) and int(events.seq.max()) == 200 * 40 - 1
    finally:
        capture.close()
    rows, used = kept_strings(postgres_url, run_id)
    assert rows == used and "r0" not in rows  # NOTE: the dropped events' request ids went with them
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "runs", postgres_url, "--json"], capture_output=True, text=True, check=True
    )
    (entry,) = [r for r in json.loads(out.stdout)["runs"] if r["id"] == run_id]
    assert (
        entry["retention"]["dropped_events"] == int(kept.first_seq) and entry["retention"]["max_bytes"] == BOUND_BYTES
    )
