"""PostgreSQL stays optional: a SQLite capture is written and read without importing its driver, and
without a server the PostgreSQL-marked tests are skipped with their reason printed, never silently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SQLITE_ONLY = """
import sys
from kvscope.telemetry import EventKind, PoolName
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.remote import RemoteRecorder

with SQLRecorder(sys.argv[1]) as recorder:
    recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid="r", num_tokens=1, slots=[3])
remote = RemoteRecorder(sys.argv[2])
remote.record(EventKind.ALLOC, pool=PoolName.FULL, rid="r", num_tokens=1, slots=[3])
remote.close()
for path in sys.argv[1:]:
    capture = Capture(path)
    assert len(capture.events(1, limit=None)) == 1
    capture.close()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("psycopg", "psycopg2", "psycopg_binary")))
"""


def test_sqlite_captures_never_import_a_postgresql_driver(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SQLITE_ONLY, str(tmp_path / "a.db"), str(tmp_path / "b.db")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_without_a_server_the_postgres_tests_are_skipped_with_the_reason_shown() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_TEST_POSTGRES")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/telemetry/test_postgres_writers.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped, done.stdout[-2000:]
    assert all("needs a PostgreSQL server: KVSCOPE_TEST_POSTGRES_URL is not set" in line for line in skipped)
