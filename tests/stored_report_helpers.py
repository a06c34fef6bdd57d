"""Recording a capture through the real CLI, and comparing leak reports apart from when they
were stored: shared by the tests of storing a report (app) and of trusting one (debug)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from kvscope.debug import LeakReport

ROOT = Path(__file__).resolve().parents[1]


def record(path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "run",
            "--workload",
            "shared-prefix",
            "--num-requests",
            "24",
            "--kv-tokens",
            "1024",
            "--capture",
            str(path),
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    return done


def same(a: LeakReport, b: LeakReport) -> bool:
    return dataclasses.replace(a, stored_at=None) == dataclasses.replace(b, stored_at=None)
