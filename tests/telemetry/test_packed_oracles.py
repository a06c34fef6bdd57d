"""Every derived read equals its version-5 self (oracle_reads.py: the SQL over `events` as of
commit dd8591d) on real captures of the previous release, read both ways: the v5 file as it
is (the row layout) and a copy packed by `upgrade` (schema version 6). The tree at a step and
the leak report are compared between the two layouts."""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from kvscope.debug.report import build_report
from kvscope.telemetry import derived, sharing
from kvscope.telemetry.events import EventKind, EvictReason, PoolName
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.upgrade import upgrade
from tests.telemetry import oracle_reads

V5 = sorted((Path(__file__).parent / "data" / "v5").glob("*.db"))
LAYOUTS = ("rows", "packed")
NO_EVICTIONS = ("page", "scoped")  # pools large enough for no eviction
SEEDS = range(6)


class Pair:
    """One capture as two files of the same events: `rows` (the row layout, where the oracles
    read) and `packed`. From a v5 capture: a copy, and a copy packed by `upgrade`. From a random
    recording (packed): the recording, and a copy written back as rows (unpack_to_rows)."""

    def __init__(self, name: str, paths: dict[str, Path]) -> None:
        self.name, self.paths = name, paths
        self.captures = {layout: Capture(path) for layout, path in paths.items()}

    @classmethod
    def of_v5(cls, folder: Path, source: Path) -> Pair:
        paths = {"rows": folder / f"rows-{source.name}", "packed": folder / f"packed-{source.name}"}
        for path in paths.values():
            shutil.copy(source, path)
        upgrade(paths["packed"])
        return cls(source.stem, paths)

    @classmethod
    def of_random(cls, folder: Path, seed: int) -> Pair:
        paths = {"rows": folder / f"rows-{seed}.db", "packed": folder / f"packed-{seed}.db"}
        record_random_events(paths["packed"], seed)
        shutil.copy(paths["packed"], paths["rows"])
        oracle_reads.unpack_to_rows(paths["rows"])
        return cls(f"random-{seed}", paths)

    @property
    def oracle(self) -> Capture:
        return self.captures["rows"]

    def steps(self, count: int = 5) -> list[int]:
        """`count` steps across the run's events, from its first step to one past its last."""
        steps = self.oracle.events(1, limit=None, columns=["step"]).step
        return sorted({int(s) for s in np.linspace(int(steps.min()), int(steps.max()) + 1, count)})

    def rids(self) -> list[str]:
        return sorted(str(r) for r in self.oracle.events(1, limit=None, columns=["rid"]).rid.dropna().unique())

    def close(self) -> None:
        for capture in self.captures.values():
            capture.close()


def record_random_events(path: Path, seed: int, num_steps: int = 120) -> None:
    """Events of every kind the derived reads look at, at random but shaped like a tree's: nodes
    inserted under earlier ones, split (chains of splits of splits), matched, locked, evicted
    (every reason, NULL pool or reason too, so summaries have ties), promoted and demoted; requests
    that match, allocate (one by one and batched), and end, some re-matching after a retract.
    Flushed at random, so the packed run has many chunks."""
    rng = random.Random(seed)
    principals = [None, "alice", "bob", "carol"]
    nodes, rids, next_node = [1], [], 2
    with SQLRecorder(path, level="full") as rec:
        for step in range(num_steps):
            rec.step = step + rng.choice((0, 0, 0, 5))  # some steps have no event
            for _ in range(rng.randint(0, 25)):
                kind = rng.choice(RANDOM_KINDS)
                node, rid = rng.choice(nodes), rng.choice(rids) if rids else None
                who, tokens = rng.choice(principals), rng.randint(0, 40)
                if kind is EventKind.REQUEST_ARRIVE or rid is None:
                    rids.append(f"r{len(rids):03d}")
                    rec.record(EventKind.REQUEST_ARRIVE, rid=rids[-1])
                elif kind in (EventKind.INSERT, EventKind.SPLIT):
                    rec.record(kind, pool=PoolName.FULL, node_id=next_node, aux=node, num_tokens=tokens, principal=who)
                    nodes.append(next_node)
                    next_node += 1
                elif kind is EventKind.MATCH:
                    rec.record(
                        kind,
                        rid=rid,
                        node_id=rng.choice((node, node, None)),
                        num_tokens=tokens,
                        aux=rng.choice((0, rng.randint(1, 30))),
                        principal=who,
                    )
                elif kind is EventKind.ALLOC and rng.random() < 0.3:
                    chosen = rng.sample(rids, min(len(rids), 3))
                    counts = [rng.randint(1, 4) for _ in chosen]
                    rec.record_batch(
                        kind,
                        pool=PoolName.FULL,
                        rids=chosen,
                        num_tokens=counts,
                        slots=np.arange(sum(counts), dtype=np.int32),
                    )
                elif kind is EventKind.ALLOC:
                    rec.record(
                        kind,
                        pool=rng.choice((PoolName.FULL, PoolName.SWA)),
                        rid=rid,
                        num_tokens=tokens,
                        slots=np.arange(tokens, dtype=np.int32),
                    )
                elif kind is EventKind.EVICT:
                    rec.record(
                        kind,
                        pool=rng.choice((PoolName.FULL, PoolName.SWA, None)),
                        node_id=node,
                        num_tokens=tokens,
                        reason=rng.choice((*EvictReason, None)),
                        slots=np.arange(tokens, dtype=np.int32),
                    )
                elif kind in (EventKind.LOCK, EventKind.PROMOTE, EventKind.DEMOTE, EventKind.CROSS_HIT):
                    rec.record(kind, rid=rid, node_id=node, num_tokens=tokens, principal=who)
                else:  # the ends of a request
                    rec.record(kind, rid=rid)
            if rng.random() < 0.2:
                rec.flush()


RANDOM_KINDS = (
    EventKind.REQUEST_ARRIVE,
    EventKind.INSERT,
    EventKind.INSERT,
    EventKind.SPLIT,
    EventKind.MATCH,
    EventKind.MATCH,
    EventKind.MATCH,
    EventKind.ALLOC,
    EventKind.ALLOC,
    EventKind.ALLOC,
    EventKind.EVICT,
    EventKind.EVICT,
    EventKind.LOCK,
    EventKind.PROMOTE,
    EventKind.DEMOTE,
    EventKind.CROSS_HIT,
    EventKind.REQUEST_FINISH,
    EventKind.REQUEST_ABORT,
    EventKind.REQUEST_RETRACT,
)


@pytest.fixture(scope="module", params=[*V5, *SEEDS], ids=[*(p.stem for p in V5), *(f"random-{s}" for s in SEEDS)])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    folder = tmp_path_factory.mktemp("oracles")
    made = (
        Pair.of_v5(folder, request.param) if isinstance(request.param, Path) else Pair.of_random(folder, request.param)
    )
    yield made
    made.close()


@pytest.fixture(scope="module", params=V5, ids=[p.stem for p in V5])
def v5_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    made = Pair.of_v5(tmp_path_factory.mktemp("v5"), request.param)
    yield made
    made.close()


def same(new: Callable[..., Any], old: Callable[..., Any], pair: Pair, *args: Any) -> Any:
    """new(...) on both layouts equals old(...) on the row layout; returns the oracle's answer."""
    expected = old(pair.oracle, 1, *args)
    for layout in LAYOUTS:
        got = new(pair.captures[layout], 1, *args)
        if isinstance(expected, pd.DataFrame):
            pd.testing.assert_frame_equal(got, expected, check_dtype=True, obj=f"{new.__name__} ({layout})")
            assert list(got.columns) == list(expected.columns)
        else:
            assert got == expected, f"{new.__name__} ({layout}): {got!r} != {expected!r}"
    return expected


def test_the_two_copies_hold_the_same_events_in_the_two_layouts(pair: Pair) -> None:
    counts = {}
    for layout, path in pair.paths.items():
        with sqlite3.connect(path) as conn:
            counts[layout] = (
                conn.execute("SELECT count(*) FROM events").fetchone()[0],
                conn.execute("SELECT count(*) FROM event_chunks").fetchone()[0] if layout == "packed" else 0,
            )
        conn.close()
    assert counts["rows"][0] > 500 and counts["rows"][1] == 0
    assert counts["packed"] == (0, counts["packed"][1]) and counts["packed"][1] >= 1
    events = {layout: c.events(1, limit=None) for layout, c in pair.captures.items()}
    pd.testing.assert_frame_equal(events["packed"], events["rows"])


def test_eviction_log_pages_equal_the_oracle(pair: Pair) -> None:
    total = int(oracle_reads.eviction_summary(pair.oracle, 1)["num_evictions"].sum())
    assert total > 0 or pair.name in NO_EVICTIONS
    pages = [(50, offset) for offset in range(0, total + 100, 50)] + [(7, max(0, total - 3)), (200, 0), (1, total)]
    empty = 0
    for limit, offset in pages:
        log = same(derived.eviction_log, oracle_reads.eviction_log, pair, limit, offset)
        assert len(log) == max(0, min(limit, total - offset))
        empty += log.empty
    assert empty >= 3  # pages past the end were asked


def test_running_lengths_equal_the_oracle_across_the_run(pair: Pair) -> None:
    running = 0
    for step in pair.steps(7):
        running += len(same(derived.running_lengths, oracle_reads.running_lengths, pair, step))
    assert running > 0


def test_allocations_of_requests_equal_the_oracle(pair: Pair) -> None:
    rids = pair.rids()
    assert len(rids) > 5
    for chosen in (rids[:1], rids[2:7], rids[::3], rids, [], ["no such request"]):
        same(derived.allocs_of_requests, oracle_reads.allocs_of_requests, pair, chosen)


def test_eviction_summaries_equal_the_oracle(pair: Pair) -> None:
    assert len(same(derived.eviction_summary, oracle_reads.eviction_summary, pair)) >= (pair.name not in NO_EVICTIONS)
    for max_points in (500, 7, 1):
        same(derived.evictions_over_steps, oracle_reads.evictions_over_steps, pair, max_points)
    for step in [-1, *pair.steps()]:
        same(derived.recent_evictions, oracle_reads.recent_evictions, pair, step)


def test_usage_at_equals_the_oracle(pair: Pair) -> None:
    for step in [-1, *pair.steps()]:
        same(derived.usage_at, oracle_reads.usage_at, pair, step)


def test_sharing_reads_equal_the_oracle(pair: Pair) -> None:
    same(sharing.run_principals, oracle_reads.run_principals, pair)
    same(sharing.visibility_changes, oracle_reads.visibility_changes, pair)
    same(sharing.reuse_by_principal, oracle_reads.reuse_by_principal, pair)


def test_the_tree_at_a_step_is_the_same_from_both_layouts(v5_pair: Pair) -> None:
    nodes = 0
    for step in v5_pair.steps():
        rows, packed = (v5_pair.captures[layout].tree_at(1, step) for layout in LAYOUTS)
        pd.testing.assert_frame_equal(packed, rows)
        nodes += len(rows)
    assert nodes > 0


def test_the_leak_report_is_the_same_from_both_layouts(v5_pair: Pair) -> None:
    reports = {layout: json.loads(build_report(path).to_json()) for layout, path in v5_pair.paths.items()}
    for report in reports.values():
        report.pop("capture")  # the file's name
    assert reports["packed"] == reports["rows"]
    assert reports["rows"]["through_seq"] > 1000


def test_unpacking_a_packed_copy_gives_back_the_rows(v5_pair: Pair, tmp_path: Path) -> None:
    pair = v5_pair
    unpacked = tmp_path / "unpacked.db"
    shutil.copy(pair.paths["packed"], unpacked)
    assert oracle_reads.unpack_to_rows(unpacked) > 1000
    capture = Capture(unpacked)
    try:
        assert capture.packed.chunks(1).empty
        pd.testing.assert_frame_equal(capture.events(1, limit=None), pair.oracle.events(1, limit=None))
        pd.testing.assert_frame_equal(
            oracle_reads.eviction_log(capture, 1, 100, 0), oracle_reads.eviction_log(pair.oracle, 1, 100, 0)
        )
    finally:
        capture.close()
