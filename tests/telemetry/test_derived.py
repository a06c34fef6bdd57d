"""The dashboard's derived reads against their first, correlated-SQL versions (reference_sql.py)
on real engine captures with evictions, splits and retractions; and the split-born parent case
the reference gets wrong, built event by event."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvscope.app import RunSpec, run
from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import MODEL_PRESETS, model_config
from kvscope.telemetry import EventKind, EvictReason, PoolName, derived
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from tests.engine.test_logits_equality import make_requests
from tests.telemetry import oracle_reads, reference_sql

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tight_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A paged radix run on a pool small enough to evict and retract often."""
    path = tmp_path_factory.mktemp("derived") / "tight.db"
    engine = EngineConfig(
        pool=PoolConfig(kv_size_tokens=700, page_size=4, max_running_requests=16),
        cache=CacheConfig(kind="radix"),
        scheduler=SchedulerConfig(chunked_prefill_size=32),
    )
    run(
        RunSpec(
            engine=engine,
            model=model_config("tiny"),
            workload="multi-turn",
            num_requests=60,
            seed=3,
            capture=path,
            store_report=False,
        )
    )
    oracle_reads.unpack_to_rows(path)  # NOTE: the references are SQL over `events` rows
    return path


@pytest.fixture(scope="module")
def retracting_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Long outputs in a small pool: decode runs out of memory, retracts, and re-matches."""
    path = tmp_path_factory.mktemp("derived") / "retracting.db"
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=256, max_running_requests=8, max_context_len=160),
        cache=CacheConfig(kind="radix"),
        scheduler=SchedulerConfig(chunked_prefill_size=16),
    )
    with SQLRecorder(path, level="full") as rec:
        stats = Engine(config, MODEL_PRESETS["tiny"], rec).run(make_requests(7, out_range=(24, 48)))
    assert stats.num_retractions > 0
    oracle_reads.unpack_to_rows(path)  # NOTE: the references are SQL over `events` rows
    return path


def sample_as_rows(name: str, tmp_path: Path) -> Path:
    """A copy of a sample capture with its events as rows (the references are SQL over them)."""
    path = tmp_path / f"{name}.db"
    shutil.copy(ROOT / "sample_runs" / f"{name}.db", path)
    oracle_reads.unpack_to_rows(path)
    return path


def split_born(path: Path) -> set[int]:
    with sqlite3.connect(path) as conn:
        return {n for (n,) in conn.execute("SELECT node_id FROM events WHERE kind = 'split'")}


@pytest.mark.parametrize("source", ["tight", "retracting", "shared-prefix", "hybrid-swa", "leaky"])
def test_eviction_log_equals_the_reference(source: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    path = (
        request.getfixturevalue(f"{source}_capture")
        if source in ("tight", "retracting")
        else sample_as_rows(source, tmp_path)
    )
    capture = Capture(path)
    try:
        total = int(derived.eviction_summary(capture, 1)["num_evictions"].sum())
        if source == "tight":
            assert total > 100  # the comparison below must cover many evictions
        for offset in range(0, total, 50):
            fast = derived.eviction_log(capture, 1, 50, offset)
            slow = reference_sql.eviction_log(capture.engine, 1, 50, offset)
            assert len(fast) == len(slow) == min(50, total - offset)
            same_parent = ~fast["node_id"].isin(split_born(path)).to_numpy()
            pd.testing.assert_frame_equal(
                fast[same_parent].reset_index(drop=True), slow[same_parent].reset_index(drop=True), check_dtype=False
            )
            cols = ["seq", "step", "node_id", "evicted_tokens", "age_steps", "idle_steps"]
            pd.testing.assert_frame_equal(fast[cols], slow[cols], check_dtype=False)
    finally:
        capture.close()


@pytest.mark.parametrize("source", ["tight", "retracting"])
def test_running_lengths_equal_the_reference_at_every_step(source: str, request: pytest.FixtureRequest) -> None:
    capture = Capture(request.getfixturevalue(f"{source}_capture"))
    try:
        last = int(capture.usage(1, 1_000_000)["step"].max())
        nonempty = 0
        for step in range(0, last + 1):
            fast = derived.running_lengths(capture, 1, step).sort_values("rid").reset_index(drop=True)
            slow = reference_sql.running_lengths(capture.engine, 1, step).sort_values("rid").reset_index(drop=True)
            pd.testing.assert_frame_equal(fast, slow, check_dtype=False)
            nonempty += not fast.empty
        assert nonempty > 10
    finally:
        capture.close()


def test_a_split_born_node_takes_the_parent_the_split_node_had(tmp_path: Path) -> None:
    db = tmp_path / "split.db"
    slots = np.arange(4, dtype=np.int64)
    with SQLRecorder(db, level="full") as rec:
        for step, kind, kw in (
            (0, EventKind.INSERT, {"node_id": 5, "aux": 1, "num_tokens": 8}),  # 5 under 1
            (1, EventKind.SPLIT, {"node_id": 6, "aux": 5, "num_tokens": 4}),  # 1 -> 6 -> 5
            (2, EventKind.SPLIT, {"node_id": 7, "aux": 6, "num_tokens": 2}),  # 1 -> 7 -> 6 -> 5
            (3, EventKind.EVICT, {"node_id": 5, "num_tokens": 4, "reason": EvictReason.CAPACITY, "slots": slots}),
            (4, EventKind.EVICT, {"node_id": 6, "num_tokens": 2, "reason": EvictReason.CAPACITY, "slots": slots[:2]}),
            (5, EventKind.MATCH, {"node_id": 7, "num_tokens": 2, "aux": 3, "rid": "again"}),
        ):
            rec.step = step
            rec.record(kind, pool=PoolName.FULL, **kw)
    capture = Capture(db)
    try:
        log = derived.eviction_log(capture, 1, 10, 0)
    finally:
        capture.close()
    assert log["parent_id"].tolist() == [6, 7]
    assert log["age_steps"].tolist() == [3, 3]  # 5 born at step 0, 6 at step 1
    assert log["needed_again_by"].isna().tolist() == [True, False] and log["needed_again_by"][1] == "again"
    assert log["regret_tokens"].tolist() == [0, 2]
