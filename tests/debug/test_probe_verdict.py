"""`kvscope check` on a probe capture says how far its censuses reach: requests that finished after
the last census were seen by none, so the verdict is inconclusive, never a plain clean; with a
census after them (the drain's) it is clean and counts the censuses by kind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.probe import BlockView, census_checks, take_census
from kvscope.telemetry import RequestRecord, RequestStatus, SQLRecorder

ROOT = Path(__file__).resolve().parents[2]


def write(target: Path, censuses: list[tuple[int, str]], finished_at: list[int]) -> Path:
    """A finished probe run: a clean census at each (step, kind), a request finished at each step."""
    with SQLRecorder(target, config={"source": {"kind": "probe", "engine": "vllm", "version": "0.32.0"}}) as rec:
        for i, step in enumerate(finished_at):
            record = RequestRecord(f"r{i}", None, 16, RequestStatus.FINISHED, 0, 4, 0)
            record.mark("finish", step, float(step))
            rec.request(record)
        for step, kind in censuses:
            result = take_census(BlockView({1: 0}, set(), [1], 1), [], [], set(), {})
            for check in census_checks(step, result, kind):
                rec.leak_check(check)
    return target


def check(capture: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "check", str(capture)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def test_requests_finished_after_the_last_census_make_the_verdict_inconclusive(tmp_path: Path) -> None:
    capture = write(tmp_path / "busy.db", [(5, "busy"), (10, "busy")], [3, 8, 12, 14])
    out = check(capture)
    assert out.returncode == 3, out.stdout + out.stderr
    assert (
        "inconclusive: 2 censuses (2 busy) of the vllm 0.32.0 probe held, but 2 requests finished after the "
        "last one (step 10)"
    ) in out.stdout


@pytest.mark.parametrize("last", [14, 15])  # NOTE: a census at a step sees the requests finished in it
def test_a_census_after_the_last_finish_makes_it_clean_with_the_censuses_by_kind(tmp_path: Path, last: int) -> None:
    capture = write(tmp_path / "drained.db", [(5, "busy"), (10, "busy"), (last, "drain")], [3, 8, 12, 14])
    out = check(capture)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "clean: 3 censuses (2 busy, 1 drain) of the vllm 0.32.0 probe's block census held" in out.stdout
