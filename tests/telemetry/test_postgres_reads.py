"""The same recorded runs read from SQLite and from PostgreSQL give identical answers: every derived
read, the run tables, the tree at a step and the leak report (against a real server: `make
test-postgres`). The server copies are made table by table (pg_copy.py) at the capture's own schema
version; a version-5 copy is read in the row layout as it is, and again after `kvscope upgrade` packed
it on the server. The oracles (oracle_reads.py, SQL over the row layout) read the SQLite rows."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from kvscope.dashboard.leak_views import held_locks
from kvscope.debug.report import build_report
from kvscope.telemetry import derived, sharing
from kvscope.telemetry.events import EventKind
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.upgrade import upgrade
from tests.conftest import postgres_database
from tests.telemetry import oracle_reads
from tests.telemetry.pg_copy import copy_capture
from tests.telemetry.test_packed_oracles import V5, Pair

pytestmark = pytest.mark.postgres
SEEDS = (0, 1)


class Copies:
    """One run as SQLite files and server databases: `sqlite` (a v5 file as it is, or a random recording),
    `oracle_rows` (the row layout the oracles read: the v5 file, or the recording unpacked) and the
    server copies by name."""

    def __init__(self, pair: Pair, servers: dict[str, str]) -> None:
        self.pair = pair
        self.servers = servers
        self.captures = {name: Capture(url) for name, url in servers.items()}

    @property
    def sqlite(self) -> Capture:
        return self.pair.captures["packed"]

    @property
    def oracle(self) -> Capture:
        return self.pair.oracle

    def all(self) -> dict[str, Capture]:
        return {"sqlite-rows": self.pair.captures["rows"], "sqlite-packed": self.sqlite, **self.captures}

    def close(self) -> None:
        for capture in self.captures.values():
            capture.close()
        self.pair.close()


@pytest.fixture(scope="module", params=[*V5, *SEEDS], ids=[*(p.stem for p in V5), *(f"random-{s}" for s in SEEDS)])
def copies(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Copies]:
    folder = tmp_path_factory.mktemp("pg")
    with ExitStack() as stack:
        servers = {}
        if isinstance(request.param, Path):
            pair = Pair.of_v5(folder, request.param)
            servers["pg-rows"] = stack.enter_context(postgres_database())
            copy_capture(pair.paths["rows"], servers["pg-rows"])
            servers["pg-upgraded"] = stack.enter_context(postgres_database())
            copy_capture(pair.paths["rows"], servers["pg-upgraded"])
            assert upgrade(servers["pg-upgraded"])  # packs the run on the server
        else:
            pair = Pair.of_random(folder, request.param)
            servers["pg-packed"] = stack.enter_context(postgres_database())
            copy_capture(pair.paths["packed"], servers["pg-packed"])
        made = Copies(pair, servers)
        yield made
        made.close()


def same(read: Callable[..., Any], copies: Copies, *args: Any, oracle: Callable[..., Any] | None = None) -> Any:
    """read(...) gives one answer on every copy (and equals the oracle's on the SQLite rows)."""
    expected = (oracle or read)(copies.oracle, 1, *args)
    for name, capture in copies.all().items():
        got = read(capture, 1, *args)
        if isinstance(expected, pd.DataFrame):
            pd.testing.assert_frame_equal(got, expected, check_dtype=True, obj=f"{read.__name__} ({name})")
        else:
            assert got == expected, f"{read.__name__} ({name}): {got!r} != {expected!r}"
    return expected


def test_the_server_copies_hold_the_runs(copies: Copies) -> None:
    for name, capture in copies.captures.items():
        assert capture.engine.dialect.name == "postgresql", name
        runs = capture.runs()
        expected = copies.sqlite.runs()
        pd.testing.assert_frame_equal(runs, expected, obj=f"runs ({name})")
    events = copies.oracle.events(1, limit=None)
    assert len(events) > 500
    for name, capture in copies.all().items():
        pd.testing.assert_frame_equal(capture.events(1, limit=None), events, obj=f"events ({name})")


def held_locks_of_events(capture: Capture, run_id: int, step: int) -> pd.DataFrame:
    """The locks held after `step`, paired from every lock and unlock (the Radix tree page's read before
    schema version 11)."""
    columns = ["seq", "step", "kind", "rid", "node_id", "aux", "reason"]
    events = capture.events(run_id, kinds=[EventKind.LOCK, EventKind.UNLOCK], limit=None, columns=columns)
    held = held_locks(events, step).reset_index(drop=True)
    return held.astype({"node_id": "int64", "since_step": "int64", "rid": object})


def test_derived_reads_are_the_same_on_both_databases(copies: Copies) -> None:
    pair = copies.pair
    total = int(oracle_reads.eviction_summary(copies.oracle, 1)["num_evictions"].sum())
    for limit, offset in [(50, 0), (50, 50), (7, max(0, total - 3)), (200, 0), (1, total)]:
        same(derived.eviction_log, copies, limit, offset, oracle=oracle_reads.eviction_log)
    for step in [-1, *pair.steps(7)]:
        same(derived.running_lengths, copies, step, oracle=oracle_reads.running_lengths)
        same(derived.recent_evictions, copies, step, oracle=oracle_reads.recent_evictions)
        same(derived.usage_at, copies, step, oracle=oracle_reads.usage_at)
        same(derived.held_locks, copies, step, oracle=held_locks_of_events)
    rids = pair.rids()
    for chosen in (rids[:1], rids[::3], rids, [], ["no such request"]):
        same(derived.allocs_of_requests, copies, chosen, oracle=oracle_reads.allocs_of_requests)
    same(derived.eviction_summary, copies, oracle=oracle_reads.eviction_summary)
    for max_points in (500, 7, 1):
        same(derived.evictions_over_steps, copies, max_points, oracle=oracle_reads.evictions_over_steps)
    same(sharing.run_principals, copies, oracle=oracle_reads.run_principals)
    same(sharing.visibility_changes, copies, oracle=oracle_reads.visibility_changes)
    same(sharing.reuse_by_principal, copies, oracle=oracle_reads.reuse_by_principal)


def test_run_tables_are_the_same_on_both_databases(copies: Copies) -> None:
    for read in (
        Capture.usage,
        Capture.latest_usage,
        Capture.step_range,
        Capture.leak_checks,
        Capture.requests,
        Capture.request_totals,
        Capture.event_counts,
        Capture.request_principals,
        Capture.snapshot_steps,
        Capture.first_arrival,
    ):
        same(read, copies)


def test_the_tree_at_a_step_is_the_same_on_both_databases(copies: Copies) -> None:
    nodes = 0
    for step in copies.pair.steps():
        nodes += len(same(Capture.tree_at, copies, step))
    assert nodes > 0 or copies.pair.name.startswith("random")


def test_the_leak_report_is_the_same_on_both_databases(copies: Copies, tmp_path: Path) -> None:
    def report(target: str | Path) -> dict[str, Any]:
        body = json.loads(build_report(target).to_json())
        body.pop("capture")  # the file's name or the URL
        return body

    expected = report(copies.pair.paths["rows"])
    for name, url in copies.servers.items():
        assert report(url) == expected, name
    shutil.rmtree(tmp_path, ignore_errors=True)
