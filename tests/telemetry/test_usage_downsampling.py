"""Capture.usage downsampled: each bucket of steps keeps whole rows the run recorded (each pool's
peak row), so the usage chart's stacked terms (charts.pool_terms) are never negative, sum to the
pool's total, and the run's peak and last row are kept. Per-column maxima taken from different
steps broke all three (a negative "held by requests")."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.dashboard.charts import pool_terms, pools_of
from kvscope.telemetry import Capture, PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder

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
    """The steps Capture.usage keeps, by its rule computed here row by row: buckets of equal width
    over [lo, hi], in each one per pool the row with the most tokens in use (missing: -1), the latest
    on a tie; and the last row."""
    steps = every.index.to_numpy()
    lo, hi = int(steps.min()), int(steps.max())
    pools = pools_of(every.reset_index())
    width = -(-(hi - lo + 1) // max(1, (max_points - 1) // len(pools)))
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
