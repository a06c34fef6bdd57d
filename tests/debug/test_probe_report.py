"""`kvscope report leaks` on a probe capture whose census fails at several idle points: the first
failure (the onset) and the last one, where the census names everything still wrong (a double free
after an earlier leak is not hidden behind the leak)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.debug.test_census_replay import write

ROOT = Path(__file__).resolve().parents[2]


def test_report_names_the_last_failing_census_too(tmp_path: Path) -> None:
    capture = write(tmp_path / "probe.db")  # step 2: block 4 leaked; step 3: that, and block 5 freed twice
    report = subprocess.run(
        [sys.executable, "-m", "kvscope", "report", "leaks", str(capture)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert report.returncode == 0, report.stderr
    first, last = report.stdout.split("first failure at step 2:")[1].split("last failure at step 3")
    assert "block 4 ref 1" in first and "block 5" not in first
    assert "block 4 ref 1, accounted 0; last taken by request r2 (alloc at step 2)" in last
    assert "block 5 ref -1, accounted 0; last released for request r3 (free at step 3)" in last
    assert "verdict: leak (kvscope check exits 1)" in report.stdout
