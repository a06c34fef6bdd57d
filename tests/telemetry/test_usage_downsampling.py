"""Capture.usage downsampled: each bucket of steps keeps whole rows the run recorded (each pool's
peak row), so the usage chart's stacked terms (charts.pool_terms) are never negative, sum to the
pool's total, and the run's peak and last row are kept. Per-column maxima taken from different
steps broke all three (a negative "held by requests")."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.dashboard.charts import pool_terms, pools_of
from kvscope.telemetry import Capture, PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder
from tests.telemetry.test_latest_usage import count_vm_steps

TERMS = ("free", "evictable", "protected", "requests")


def random_terms(rng: np.random.Generator, total: int) -> PoolTerms:
    """A consistent row: free + evictable + protected + held by requests == total, each >= 0."""
    free, evictable_end, protected_end = np.sort(rng.integers(0, total + 1, size=3))
    return PoolTerms(total, int(free), int(evictable_end - free), int(protected_end - evictable_end))


def record(path: Path, steps: list[int], rng: np.random.Generator, with_swa: bool, full_total: int = 1024) -> None:
    with SQLRecorder(path, level="summary", label="usage") as rec:
        for step in steps:
            rec.step = step
            swa = random_terms(rng, min(256, full_total)) if with_swa else None
            rec.usage(
                UsageSample(
                    step, random_terms(rng, full_total), swa, 8, 8, int(rng.integers(0, 8)), 0, step, 0, step, 0, 0, 0
                )
            )


def every_and_kept(
    steps: list[int], rng: np.random.Generator, with_swa: bool, max_points: int, full_total: int = 1024
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A run recorded at `steps`, read back whole (by step) and downsampled to `max_points`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "usage.db"
        record(path, steps, rng, with_swa, full_total=full_total)
        capture = Capture(path)
        try:
            run_id = int(capture.latest_run_id() or 0)
            every = capture.usage(run_id, max_points=10 * len(steps)).set_index("step")
            return every, capture.usage(run_id, max_points=max_points)
        finally:
            capture.close()


def in_use(frame: pd.DataFrame, pool: str) -> pd.Series:
    return frame[f"{pool}_total"] - frame[f"{pool}_available"]


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_steps=st.integers(1, 300),
    max_gap=st.integers(1, 3),
    max_points=st.integers(4, 60),
    with_swa=st.booleans(),
)
def test_downsampled_rows_are_whole_rows_whose_terms_stack_to_the_total(
    seed: int, num_steps: int, max_gap: int, max_points: int, with_swa: bool
) -> None:
    rng = np.random.default_rng(seed)
    steps = np.cumsum(rng.integers(1, max_gap + 1, size=num_steps)).tolist()
    every, kept = every_and_kept(steps, rng, with_swa, max_points)
    assert len(every) == num_steps
    assert len(kept) <= max_points
    assert kept["step"].is_monotonic_increasing and kept["step"].iloc[-1] == steps[-1]
    for pool in pools_of(kept):
        terms = pool_terms(kept, pool)
        assert (terms[list(TERMS)] >= 0).all().all(), terms[terms["requests"] < 0]
        assert (terms[list(TERMS)].sum(axis=1) == terms["total"]).all()
        assert in_use(kept, pool).max() == in_use(every, pool).max(), f"{pool}: the peak was lost"
    columns = [c for c in every.columns if every[c].notna().any()]
    recorded = every.loc[kept["step"], columns].reset_index()
    assert recorded.equals(kept[["step", *columns]].reset_index(drop=True)), "a kept row is not a recorded row"


def peak_steps(every: pd.DataFrame, max_points: int) -> list[int]:
    """The steps Capture.usage keeps, by its rule computed here row by row: buckets over [lo, hi] of
    the least power-of-two width that leaves at most (max_points - 1) // pools of them, in each one
    per pool the row with the most tokens in use (missing: -1), the latest on a tie; and the last row."""
    steps = every.index.to_numpy()
    lo, hi = int(steps.min()), int(steps.max())
    pools = pools_of(every.reset_index())
    width = 1
    while -(-(hi - lo + 1) // width) > max(1, (max_points - 1) // len(pools)):
        width *= 2
    kept = {hi}
    for _, rows in every.groupby((steps - lo) // width):
        for pool in pools:
            peak = in_use(rows, pool).fillna(-1)
            kept.add(int(peak[peak == peak.max()].index.max()))
    return sorted(kept)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_steps=st.integers(1, 200),
    first_step=st.integers(0, 5),
    max_points=st.integers(2, 40),
    with_swa=st.booleans(),
)
def test_each_bucket_keeps_each_pools_peak_row_and_the_latest_on_a_tie(
    seed: int, num_steps: int, first_step: int, max_points: int, with_swa: bool
) -> None:
    """Totals of 4 tokens make ties common: the kept steps are exactly the rule's, peak then latest."""
    rng = np.random.default_rng(seed)
    steps = (first_step + np.cumsum(rng.integers(1, 3, size=num_steps))).tolist()
    every, kept = every_and_kept(steps, rng, with_swa, max_points, full_total=4)
    assert kept["step"].tolist() == peak_steps(every, max_points)


# -- a live run: reads as rows are appended (and thinned) equal a fresh reader's -------------------


def append_rows(path: Path, steps: list[int], rng: np.random.Generator, with_swa: bool) -> None:
    """Rows at `steps` as a live writer appends them: a copy of the run's first row, 4 tokens per pool
    (ties are common), an SWA pool when `with_swa`."""
    with sqlite3.connect(path) as conn:
        conn.row_factory = sqlite3.Row
        first = dict(conn.execute("SELECT * FROM usage ORDER BY step LIMIT 1").fetchone())
        rows = [
            {
                **first,
                "step": step,
                "t_mono": float(step),
                "full_available": int(rng.integers(0, 5)),
                "swa_total": 4 if with_swa else None,
                "swa_available": int(rng.integers(0, 5)) if with_swa else None,
            }
            for step in steps
        ]
        names = ", ".join(first)
        conn.executemany(f"INSERT INTO usage ({names}) VALUES ({', '.join(':' + n for n in first)})", rows)


def thin_rows(path: Path, rng: np.random.Generator) -> None:
    """As retention thins a run's old usage rows: about a third of them go, the last row stays."""
    with sqlite3.connect(path) as conn:
        steps = [step for (step,) in conn.execute("SELECT step FROM usage ORDER BY step")][:-1]
        gone = [(step,) for step in steps if rng.random() < 0.35]
        conn.executemany("DELETE FROM usage WHERE step = ?", gone)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batches=st.lists(st.integers(1, 90), min_size=1, max_size=6),
    max_points=st.integers(3, 30),
    swa_from=st.sampled_from([None, 0, 2]),
    thin_after=st.sets(st.integers(0, 5), max_size=2),
)
def test_reads_of_a_growing_run_equal_a_fresh_readers(
    seed: int, batches: list[int], max_points: int, swa_from: int | None, thin_after: set[int]
) -> None:
    """One reader kept open across a live run's appends (Capture.usage goes on from the buckets its last
    read left open: usage_buckets.py) reads what a reader opened afresh reads, and the rule's steps; with
    an SWA pool that appears mid-run and old rows thinned away (a kept peak row among them, at times)."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "live.db"
        record(path, [0], rng, with_swa=swa_from == 0, full_total=4)
        live, last = Capture(path), 0
        try:
            for i, size in enumerate(batches):
                steps = (last + np.cumsum(rng.integers(1, 3, size=size))).tolist()
                append_rows(path, steps, rng, with_swa=swa_from is not None and i >= swa_from)
                last = steps[-1]
                if i in thin_after:
                    thin_rows(path, rng)
                kept = live.usage(1, max_points=max_points)
                fresh = Capture(path)
                try:
                    every = fresh.usage(1, max_points=10 * (last + 1)).set_index("step")
                    assert kept.equals(fresh.usage(1, max_points=max_points))
                finally:
                    fresh.close()
                assert kept["step"].tolist() == peak_steps(every, max_points)
        finally:
            live.close()


def vm_steps_of_a_refresh(path: Path, num_steps: int) -> int:
    """SQLite's virtual-machine instructions (in hundreds) of one Capture.usage after 100 rows were
    appended to a run of `num_steps` steps that the same reader had read."""
    rng = np.random.default_rng(0)
    record(path, [0], rng, with_swa=False, full_total=4)
    append_rows(path, list(range(1, num_steps)), rng, with_swa=False)
    capture = Capture(path)
    try:
        capture.usage(1)
        append_rows(path, list(range(num_steps, num_steps + 100)), rng, with_swa=False)
        counted = count_vm_steps(capture)
        assert capture.usage(1)["step"].iloc[-1] == num_steps + 99
    finally:
        capture.close()
    return counted[0]


def test_a_live_refresh_aggregates_the_rows_appended_since_not_the_run(tmp_path: Path) -> None:
    """The same refresh on a run ten times as long costs about the same (aggregating every row: 10x)."""
    short = vm_steps_of_a_refresh(tmp_path / "short.db", 4_000)
    long = vm_steps_of_a_refresh(tmp_path / "long.db", 40_000)
    assert long < 2 * short + 50, (short, long)
