"""The Memory page's stacked pools on a downsampled series of a real capture (every sample, cut to
a few points as a long run is): no term below zero, the stack reaching exactly the pool's total."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvscope.dashboard import charts
from kvscope.dashboard.charts.usage import TERM_NAMES, TERMS
from kvscope.telemetry import Capture
from tests.dashboard.conftest import ROOT

SAMPLES = sorted((ROOT / "sample_runs").glob("*.db"))


@pytest.mark.parametrize("max_points", [4, 8, 23])
@pytest.mark.parametrize("path", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_the_stacked_pool_terms_of_a_downsampled_run_never_go_negative(path: Path, max_points: int) -> None:
    capture = Capture(path)
    try:
        usage = capture.usage(int(capture.latest_run_id() or 1), max_points=max_points)
    finally:
        capture.close()
    fig = charts.memory_timeline_figure(usage)
    for pool in charts.pools_of(usage):
        stack = [t for t in fig.data if t.stackgroup == pool]
        assert [t.name for t in stack] == [TERM_NAMES[term] for term in TERMS]
        heights = np.array([np.asarray(t.y, dtype=float) for t in stack])
        assert (heights >= 0).all(), {t.name: float(np.min(t.y)) for t in stack}
        assert np.array_equal(heights.sum(axis=0), usage[f"{pool}_total"].to_numpy(dtype=float))
