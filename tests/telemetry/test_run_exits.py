"""Only a normal end closes a run 'finished': a process recording through the probe's path
(RemoteRecorder, exit_driver.py) that ends by an exception, Ctrl-C, sys.exit(N) or a kill closes it
crashed or interrupted, with the line saying why, and `kvscope check` never calls it clean (its
census passed: a finished run would be clean). In the process itself and in a multiprocessing child."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvscope.telemetry import Capture
from kvscope.telemetry.exits import status_of

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("exit_driver.py")
KILLED = "the recording process ended without closing the run (killed)"
CASES = [
    ("close", "plain", "finished", None),
    ("end", "plain", "finished", None),
    ("exit0", "plain", "finished", None),
    ("exit3", "plain", "crashed", "exited with code 3"),
    ("exit-text", "plain", "crashed", "exited: the model failed to load"),
    ("raise", "plain", "crashed", "ValueError: block 27 ref -1"),
    ("interrupt", "plain", "interrupted", "KeyboardInterrupt"),
    ("kill", "plain", "crashed", KILLED),
    ("term", "plain", "crashed", KILLED),
    ("end", "fork", "finished", None),
    ("raise", "fork", "crashed", "ValueError: block 27 ref -1"),
    ("raise-exit3", "fork", "crashed", "exited with code 3"),
    ("interrupt", "fork", "interrupted", "KeyboardInterrupt"),
    ("exit0", "spawn", "finished", None),
    ("exit3", "spawn", "crashed", "exited with code 3"),
    ("raise", "spawn", "crashed", "ValueError: block 27 ref -1"),
]


def _closed_run(capture: Path) -> tuple[str, str | None]:
    """The run's (status, error) once it is closed (a killed process's host closes it soon after)."""
    deadline = time.monotonic() + 60
    while True:
        db = Capture(capture)
        try:
            run = db.runs().iloc[-1]
        finally:
            db.close()
        if run.status != "running" or time.monotonic() > deadline:
            return str(run.status), None if run.error is None else str(run.error)
        time.sleep(0.2)


@pytest.mark.parametrize(("how", "mode", "status", "error"), CASES)
def test_a_run_closes_finished_only_when_its_process_ends_normally(
    tmp_path: Path, how: str, mode: str, status: str, error: str | None
) -> None:
    capture = tmp_path / f"{how}-{mode}.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    env |= {"KVSCOPE_CAPTURE": str(capture), "KVSCOPE_LEVEL": "summary", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(DRIVER), how, mode], env=env, capture_output=True, timeout=180, check=False)
    assert _closed_run(capture) == (status, error)
    check = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", str(capture)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert check.returncode == (0 if status == "finished" else 3), check.stdout + check.stderr
    if error is not None:
        assert error in check.stdout, check.stdout


def test_an_exception_without_a_message_is_named_by_where_it_was_raised() -> None:
    """vLLM's `assert block.ref_cnt == 0` has no message: its line alone ('AssertionError') told an
    on-call engineer nothing; the file, line and source of the raise do."""

    def pool_check(ref_cnt: int) -> None:
        if ref_cnt != 0:
            raise RuntimeError  # NOTE: as a bare assert does (pytest rewrites a test module's asserts)

    try:
        pool_check(-1)
    except RuntimeError as err:
        ending = status_of(err)
    assert ending.status == "crashed" and ending.error is not None
    assert ending.error.startswith("RuntimeError at telemetry/test_run_exits.py:"), ending.error
    assert ending.error.endswith(
        ": raise RuntimeError  # NOTE: as a bare assert does (pytest rewrites a test module's asserts)"
    ), ending.error
    assert status_of(ValueError("no room")).error == "ValueError: no room"
