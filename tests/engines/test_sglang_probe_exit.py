"""The probe's exit-time fold (drain_at_exit, registered with atexit and multiprocessing's Finalize
so that it runs before the recorder closes its run): a process that ends between two folds, without
a census, still leaves every allocator call since the last fold in the capture. Real subprocesses
under `kvscope instrument`, SGLang 0.5.23's real allocator (sglang_exit_driver.py).

Run by `make test-engines` (`pytest -m engines`; KVSCOPE_SGLANG_PYTHON names the venv's python).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvscope.telemetry import Capture

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("sglang_exit_driver.py")
SGLANG_PYTHON = os.environ.get(
    "KVSCOPE_SGLANG_PYTHON",
    str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvscope" / "sglang-venv" / "bin" / "python"),
)
pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(SGLANG_PYTHON).exists(), reason=f"no SGLang venv at {SGLANG_PYTHON}: `make test-engines` makes it"
    ),
]


@pytest.mark.parametrize("mode", ["plain", "spawn"])
def test_the_calls_since_the_last_fold_reach_the_capture_when_the_process_exits(tmp_path: Path, mode: str) -> None:
    capture = tmp_path / f"exit-{mode}.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCOPE_", "SGLANG_"))}
    command = [SGLANG_PYTHON, "-W", "ignore", str(DRIVER), mode]
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "instrument", "--capture", str(capture), "--", *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    calls = json.loads(out.stdout.strip().splitlines()[-1])["calls"]
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        assert run.status == "finished", (run.status, out.stderr[-2000:])
        events = db.events(int(run.id), limit=100)
        recorded = [
            (kind, sorted(np.frombuffer(slots, "<i4").tolist()))
            for kind, slots in zip(events.kind, events.slots, strict=True)
        ]
    finally:
        db.close()
    assert recorded == [tuple(c) for c in calls], (recorded, calls)
