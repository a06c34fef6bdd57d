"""`kvscope run`'s capture goes where --capture says, verbatim, and a capture that stops recording
(here: a real write failure, the file-size limit) exits 4 with one line saying through which
step it is complete, stores no leak report, and stays readable."""

from __future__ import annotations

import resource
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILE_LIMIT_BYTES = 400_000


def run(*args: str, cwd: Path, file_limit_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit_files() -> None:  # in the child: writes past the limit fail with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        assert file_limit_bytes is not None
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit_bytes, file_limit_bytes))

    return subprocess.run(
        [sys.executable, "-m", "kvscope", "run", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
        preexec_fn=None if file_limit_bytes is None else limit_files,
    )


def test_a_sqlite_url_capture_lands_at_its_absolute_path(tmp_path: Path) -> None:
    target = tmp_path / "data" / "url.db"
    done = run("--workload", "random", "--num-requests", "4", "--capture", f"sqlite:///{target}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert target.exists() and not (tmp_path / "sqlite:").exists()
    assert f"capture           sqlite:///{target}" in done.stdout


def test_a_capture_that_stops_recording_exits_4(tmp_path: Path) -> None:
    done = run(
        "--workload",
        "shared-prefix",
        "--num-requests",
        "200",
        "--capture",
        "c.db",
        cwd=tmp_path,
        file_limit_bytes=FILE_LIMIT_BYTES,
    )
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr
    stopped = [line for line in done.stderr.splitlines() if "recording stopped" in line]
    assert len(stopped) == 1, done.stderr  # one line, said when it stopped
    assert stopped[0].startswith("kvscope recorder: recording stopped, capture complete through step "), done.stderr
    assert "leak report" not in done.stdout
    requests = next(line for line in done.stdout.splitlines() if line.startswith("requests "))
    assert requests.endswith("of 200 (cut short: the run stopped when recording stopped)"), done.stdout
    conn = sqlite3.connect(f"file:{tmp_path / 'c.db'}?mode=ro", uri=True)
    try:
        status, error = conn.execute("SELECT status, error FROM runs").fetchone()
        reports = conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'reports'").fetchone()[0]
        stored = conn.execute("SELECT count(*) FROM reports").fetchone()[0] if reports else 0
    finally:
        conn.close()
    assert status == "incomplete" and error.startswith("capture complete through step ")
    assert stored == 0
    check = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", "c.db"], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert check.returncode == 3 and "incomplete" in check.stdout, check.stdout + check.stderr


STALLING = (
    "--workload",
    "multi-turn",
    "--num-requests",
    "16",
    "--seed",
    "1",
    "--kv-tokens",
    "400",
    "--chunked-prefill-size",
    "64",
    "--inject-seed",
    "5",
)


def test_a_run_whose_pool_is_starved_by_leaked_locks_stops_with_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvscope", "run", *STALLING, "--inject", "lock-leak:0.4", "--capture", "c.db"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("kvscope run: stalled at step ") and "stay locked with no request running" in line
    with sqlite3.connect(tmp_path / "c.db") as conn:
        status, error = conn.execute("SELECT status, error FROM runs").fetchone()
    assert status == "crashed" and "stalled at step" in error
    report = subprocess.run(
        [sys.executable, "-m", "kvscope", "report", "leaks", "c.db"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert "lock-never-released" in report.stdout  # the debugger names the locks that starved it
    control = subprocess.run(
        [sys.executable, "-m", "kvscope", "run", *STALLING, "--level", "off"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert control.returncode == 0, control.stderr  # the same run without the leak finishes
