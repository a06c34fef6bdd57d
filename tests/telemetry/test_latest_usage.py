"""Capture.latest_usage, which every live refresh of the Overview, the Tiers page and the capability
check reads: the run's last usage row and the first one at most `window_s` seconds before it, read by
walking the usage key from its end. A scan of the run's every row (max(t_mono), then min(step) WHERE
t_mono >= ...) cost each refresh time in proportion to the run's length, and that CPU was taken from
the engine's writer beside the dashboard (bench_readers)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import event

from kvscope.telemetry import Capture, PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder


def record(path: Path, steps: list[int], t_monos: list[float]) -> None:
    """A run with a usage row at each of `steps`, its t_mono then set to `t_monos` (as a recorder's clock
    would have read them: never decreasing with the step)."""
    with SQLRecorder(path, level="summary", label="latest") as rec:
        for step in steps:
            rec.step = step
            rec.usage(UsageSample(step, PoolTerms(64, 32, 16, 8), None, 8, 8, 1, 0, step, 0, step, 0, 0, 0))
    with sqlite3.connect(path) as conn:
        conn.executemany("UPDATE usage SET t_mono = ? WHERE step = ?", list(zip(t_monos, steps, strict=True)))


def expected(steps: list[int], t_monos: list[float], window_s: float) -> list[int]:
    """The definition: the last row, and the first row whose t_mono is within window_s of the last's."""
    frame = pd.DataFrame({"step": steps, "t_mono": t_monos})
    last = frame.iloc[-1]
    first = frame[frame.t_mono >= last.t_mono - window_s].step.min()
    return sorted({int(first), int(last.step)})


@settings(max_examples=25, deadline=None)
@given(
    gaps=st.lists(st.integers(1, 5), min_size=1, max_size=60),
    ticks=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]), min_size=60, max_size=60),
    window_s=st.sampled_from([0.0, 1.0, 2.5, 10.0]),
)
def test_the_window_matches_its_definition(tmp_path_factory: pytest.TempPathFactory, gaps, ticks, window_s) -> None:
    steps = list(np.cumsum(gaps).tolist())
    t_monos = list(np.cumsum(ticks[: len(steps)]).tolist())
    path = tmp_path_factory.mktemp("latest") / "latest.db"
    record(path, steps, t_monos)
    capture = Capture(path)
    try:
        assert capture.latest_usage(1, window_s=window_s).step.tolist() == expected(steps, t_monos, window_s)
    finally:
        capture.close()


def vm_steps_of_latest_usage(path: Path, num_steps: int) -> int:
    """SQLite's virtual-machine instructions (in hundreds, counted by a progress handler) that one
    latest_usage costs on a run of `num_steps` steps 0.01 s apart, with a 1 s window (100 rows)."""
    steps = list(range(num_steps))
    record(path, steps, [step * 0.01 for step in steps])
    capture = Capture(path)
    counted = count_vm_steps(capture)
    try:
        assert capture.latest_usage(1, window_s=1.0).step.tolist() == [num_steps - 101, num_steps - 1]
    finally:
        capture.close()
    return counted[0]


def count_vm_steps(capture: Capture) -> list[int]:
    """From now on, the hundreds of SQLite VM instructions `capture`'s reads run, in the list's one item."""
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return 0

    event.listen(capture.engine, "connect", lambda conn, _record: conn.set_progress_handler(count, 100))
    capture.engine.dispose()  # NOTE: the pooled connections opened before the listener go
    return counted


def test_a_refresh_costs_the_window_not_the_run(tmp_path: Path) -> None:
    """The same window read on a run ten times as long costs about the same (the old scans cost 10x)."""
    short = vm_steps_of_latest_usage(tmp_path / "short.db", 2_000)
    long = vm_steps_of_latest_usage(tmp_path / "long.db", 20_000)
    assert long < 2 * short + 50, (short, long)


def test_usage_counts_the_pools_of_rows_appended_since_the_last_read(tmp_path: Path) -> None:
    """Capture.usage counts a run's SWA and host-tier rows only from where its last read stopped (a live
    refresh no longer counts the run's every row); a host tier that appears in rows appended since is
    still downsampled as a pool of its own: its peak row (step 150, in no bucket's last step) is kept."""
    path = tmp_path / "pools.db"
    steps = list(range(100))
    record(path, steps, [step * 0.01 for step in steps])
    capture = Capture(path)
    try:
        assert 150 not in capture.usage(1, max_points=21).step.tolist()
        with sqlite3.connect(path) as conn:  # NOTE: the live writer appends steps 100..199, with a host tier
            conn.row_factory = sqlite3.Row
            last = dict(conn.execute("SELECT * FROM usage WHERE step = 99").fetchone())
            rows = [
                {**last, "step": s, "host_total": 100, "host_available": 10 if s == 150 else 90}
                for s in range(100, 200)
            ]
            names = ", ".join(last)
            conn.executemany(f"INSERT INTO usage ({names}) VALUES ({', '.join(':' + n for n in last)})", rows)
        kept = capture.usage(1, max_points=21).step.tolist()
    finally:
        capture.close()
    assert 150 in kept and 199 in kept, kept
