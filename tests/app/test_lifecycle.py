"""How a `kvscope` process ends when it is told to stop, in real subprocesses: a signal while
pandas or torch loads, in the middle of a run, twice in a row, or as SIGTERM, gives one line
on stderr, the signal's exit code and a capture closed as 'interrupted' whose requests still
in flight have their rows."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvscope.engine.request import Req
from kvscope.engine.stats import EngineStats
from kvscope.telemetry import ListRecorder, RequestStatus

ROOT = Path(__file__).resolve().parents[2]
LEAKY = str(ROOT / "sample_runs" / "leaky.db")
CLEAN = str(ROOT / "sample_runs" / "shared-prefix.db")
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
# The console script's way in (kvscope.__main__:main), with one module's import stalled until a
# signal arrives, so the signal lands inside that import whatever the machine's speed.
STALLED = """
import sys, time

class Stall:
    def find_spec(self, name, path=None, target=None):
        if name == STALLED:
            print("stalled importing " + name, file=sys.stderr, flush=True)
            while True:
                time.sleep(0.05)

STALLED = sys.argv.pop(1)
sys.meta_path.insert(0, Stall())
from kvscope.__main__ import main
sys.exit(main())
"""
LONG_RUN = ("run", "--workload", "multi-turn", "--num-requests", "2000", "--pace", "100", "--capture", "c.db")


def stalled(module: str, *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", STALLED, module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )


def kvscope(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvscope", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd
    )


def finish(proc: subprocess.Popen[str], before: str = "") -> tuple[int, str]:
    _, err = proc.communicate(timeout=300)
    return proc.returncode, before + err


VERBS = [
    (("run", "--workload", "random", "--num-requests", "4", "--capture", "c.db"), "torch", signal.SIGINT),
    (("run", "--workload", "random", "--num-requests", "4", "--capture", "c.db"), "pandas", signal.SIGTERM),
    (("check", LEAKY), "pandas", signal.SIGINT),
    (("report", "leaks", LEAKY), "pandas", signal.SIGTERM),
    (("runs", CLEAN), "pandas", signal.SIGHUP),
    (("diff", CLEAN, LEAKY), "pandas", signal.SIGINT),
    (("replay", CLEAN, "--curve-only"), "pandas", signal.SIGINT),
]
# NOTE: `plan` is not among them: since the CLI loads each verb's modules on first use, it imports none of
# pandas, numpy or torch (it read its model before pandas had loaded)


@pytest.mark.parametrize(("args", "module", "signum"), VERBS, ids=[f"{v[0][0]}-{v[1]}-{v[2].name}" for v in VERBS])
def test_a_signal_while_heavy_modules_load_is_one_line(
    tmp_path: Path, args: tuple[str, ...], module: str, signum: signal.Signals
) -> None:
    proc = stalled(module, *args, cwd=tmp_path)
    assert proc.stderr is not None
    marker = proc.stderr.readline()
    assert marker == f"stalled importing {module}\n", marker + proc.stderr.read()
    proc.send_signal(signum)
    code, err = finish(proc)
    assert code == CODES[signum], err
    assert err == f"kvscope {args[0]}: interrupted\n"
    assert not (tmp_path / "c.db").exists(), "no capture before the engine's modules are loaded"


def run_status(path: Path) -> tuple[str, str | None, dict[str, int]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        status, error = conn.execute("SELECT status, error FROM runs").fetchone()
        requests = dict(conn.execute("SELECT status, count(*) FROM requests GROUP BY status").fetchall())
    conn.close()
    return status, error, requests


def wait_for_usage(path: Path, proc: subprocess.Popen[str], num_rows: int) -> None:
    """Until the run has recorded `num_rows` usage samples (it is past its start and running)."""
    while proc.poll() is None:
        if path.exists():
            try:
                conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
                try:
                    if conn.execute("SELECT count(*) FROM usage").fetchone()[0] >= num_rows:
                        return
                finally:
                    conn.close()
            except sqlite3.OperationalError:
                pass  # the schema is not there yet
        time.sleep(0.05)
    raise AssertionError(f"the run ended before it was signalled: {proc.communicate()}")


# (signals, the pause between them in seconds): a second Ctrl-C lands at once, or during shutdown
STOPS = [
    ((signal.SIGINT,), 0.0),
    ((signal.SIGTERM,), 0.0),
    ((signal.SIGHUP,), 0.0),
    ((signal.SIGINT, signal.SIGINT), 0.0),
    ((signal.SIGINT, signal.SIGINT, signal.SIGINT), 0.02),
    ((signal.SIGINT, signal.SIGTERM), 0.1),
]


@pytest.mark.parametrize(
    ("signals", "pause_s"), STOPS, ids=["+".join(s.name for s in x[0]) + f"-{x[1]}" for x in STOPS]
)
def test_a_run_stopped_midway_is_closed_as_interrupted(
    tmp_path: Path, signals: tuple[signal.Signals, ...], pause_s: float
) -> None:
    proc = kvscope(*LONG_RUN, cwd=tmp_path)
    wait_for_usage(tmp_path / "c.db", proc, num_rows=20)
    for signum in signals:
        proc.send_signal(signum)
        time.sleep(pause_s)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == CODES[signals[0]], err
    assert err == "kvscope run: interrupted\n"
    status, error, requests = run_status(tmp_path / "c.db")
    assert status == "interrupted" and error is not None and error.startswith(f"{signals[0].name} at step ")
    # NOTE: the summary so far, and where the capture is, as a finished run prints them
    assert out.splitlines()[-1] == f"capture           c.db (interrupted: {error})", out
    assert f" (cut short: {error}; the rest never ran)" in out.splitlines()[0], out
    assert requests.get(RequestStatus.IN_FLIGHT, 0) > 0, requests
    assert not (tmp_path / "c.db-wal").exists(), "the capture's WAL should be folded in when it closes"
    check = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", "c.db"], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert check.returncode == 3 and "interrupted" in check.stdout, check.stdout + check.stderr


def test_a_signal_right_after_the_capture_appears_still_closes_it(tmp_path: Path) -> None:
    proc = kvscope(*LONG_RUN, cwd=tmp_path)
    while not (tmp_path / "c.db").exists() and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    assert code == 130 and err == "kvscope run: interrupted\n"
    status, _, _ = run_status(tmp_path / "c.db")
    assert status == "interrupted"


def test_a_run_stopped_on_a_leak_is_closed_as_crashed(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "run",
            "--workload",
            "multi-turn",
            "--num-requests",
            "16",
            "--inject",
            "leak-tail",
            "--leak-check",
            "raise",
            "--capture",
            "c.db",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    status, error, _ = run_status(tmp_path / "c.db")
    assert status == "crashed" and error is not None and error.startswith("LeakDetected: ")


def test_requests_in_flight_get_their_rows() -> None:
    recorder = ListRecorder()
    stats = EngineStats(recorder)
    waiting, admitted, done = (Req(rid, np.array([1, 2, 3]), 2) for rid in ("w", "a", "d"))
    for req in (waiting, admitted, done):
        stats.arrived(req, step=0)
    stats.admitted(admitted, step=1, prefix_len=0)
    stats.admitted(done, step=1, prefix_len=0)
    stats.finished(done, step=2)
    stats.close_in_flight()
    assert {r.rid: r.status for r in recorder.requests} == {"d": "finished", "w": "in_flight", "a": "in_flight"}


def test_the_entry_point_imports_nothing_heavy() -> None:
    code = "import sys, kvscope.__main__; print(sorted(m for m in ('pandas', 'numpy', 'torch') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("verb", ["upgrade", "runs"])
def test_a_signal_after_the_verb_has_ended_changes_nothing(tmp_path: Path, verb: str) -> None:
    """Issue 40, point 21: SIGTERM once the verb's result is printed, while the interpreter exits. Python's
    exit hands the signal back to its default action (exit -15, no line) or raises it in an atexit hook (a
    traceback); the verb's own code and output stand, and stderr stays empty. A signal that comes before
    the verb has returned (its line printed, its return not yet taken) is the house stop: one line, 143."""
    capture = tmp_path / "c.db"
    capture.write_bytes(Path(CLEAN).read_bytes())
    for delay_s in (0.0, 0.005, 0.02, 0.05):
        proc = kvscope(verb, str(capture), cwd=ROOT)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        time.sleep(delay_s)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert first and (proc.returncode, err) in ((0, ""), (143, f"kvscope {verb}: interrupted\n")), (
            delay_s,
            proc.returncode,
            err,
        )
