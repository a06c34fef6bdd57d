"""`kvscope check` says clean (exit 0) only for a run that finished and passed at least one idle
leak check with nothing failing; a leak is 1, an unreadable capture 2, and a run that was
interrupted, crashed, is incomplete, still running or ended without closing, or that never
reached an idle check, is 3 'inconclusive' with its reason. `report leaks` never says "none"
or "clean" where the capture cannot know."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvscope.app import RunSpec, run
from kvscope.engine.config import EngineConfig, PoolConfig
from kvscope.engine.faults import FaultSpec
from kvscope.engine.model import MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_runs"


def kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )


def variant(tmp_path: Path, sample: str, sql: str, *params: Any) -> Path:
    """A copy of a sample capture with one statement applied (a real SQLite file)."""
    path = tmp_path / f"{sample.removesuffix('.db')}-variant.db"
    shutil.copy(SAMPLES / sample, path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(sql, params)
    conn.close()
    return path


STATUS = "UPDATE runs SET status = ?, error = ?"
CASES = {
    "finished-clean": ("shared-prefix.db", "UPDATE runs SET error = NULL", (), 0, "clean: 1 idle leak check balanced"),
    "finished-leak": ("leaky.db", "UPDATE runs SET error = NULL", (), 1, "leak: orphaned: "),
    "interrupted": (
        "shared-prefix.db",
        STATUS,
        ("interrupted", "SIGINT at step 20"),
        3,
        "inconclusive: the run was interrupted (SIGINT at step 20)",
    ),
    "crashed": (
        "shared-prefix.db",
        STATUS,
        ("crashed", "RuntimeError: boom"),
        3,
        "inconclusive: the run crashed (RuntimeError: boom)",
    ),
    "incomplete": (
        "shared-prefix.db",
        STATUS,
        ("incomplete", "capture complete through step 30: disk full"),
        3,
        "inconclusive: the capture is incomplete (capture complete through step 30: disk full)",
    ),
    "ended-without-closing": (
        "shared-prefix.db",
        "UPDATE runs SET status = 'running', ended_at = NULL, host = 'another-host'",
        (),
        3,
        "inconclusive: the run ended without closing",
    ),
    "no-idle-check": (
        "shared-prefix.db",
        "DELETE FROM leak_checks",
        (),
        3,
        "inconclusive: the run finished without reaching an idle point",
    ),
    # an orphan whose free was due before the run's last step is certain wherever the run stopped
    # (one due in the last step may not be: tests/debug/test_cut_short_verdict.py)
    "interrupted-after-a-leak": ("leaky.db", STATUS, ("interrupted", "SIGTERM at step 30"), 1, "leak: orphaned: "),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_exit_code_and_reason(tmp_path: Path, case: str) -> None:
    sample, sql, params, code, reason = CASES[case]
    path = variant(tmp_path, sample, sql, *params)
    out = kvscope("check", str(path))
    assert out.returncode == code, out.stdout + out.stderr
    assert out.stdout == f"{path}: {out.stdout.split(': ', 1)[1]}" and out.stdout.count("\n") == 1
    assert reason in out.stdout, out.stdout
    as_json = json.loads(kvscope("check", str(path), "--json").stdout)
    verdict = {0: "clean", 1: "leak", 3: "inconclusive"}[code]
    assert as_json == {
        "capture": str(path),
        "run": 1,
        "status": as_json["status"],
        "verdict": verdict,
        "exit_code": code,
        "reason": out.stdout.split(": ", 1)[1].strip(),
        "source": as_json["source"],
    }
    assert as_json["source"] in ("stored", "replayed")


def test_a_run_still_running_is_inconclusive(tmp_path: Path) -> None:
    path = variant(
        tmp_path,
        "shared-prefix.db",
        "UPDATE runs SET status = 'running', ended_at = NULL, host = ?, pid = ?, heartbeat_at = ?",
        socket.gethostname(),
        os.getpid(),
        time.time(),
    )
    out = kvscope("check", str(path))
    assert out.returncode == 3 and "inconclusive: the run is still running" in out.stdout, out.stdout


def test_an_unreadable_capture_is_2(tmp_path: Path) -> None:
    (tmp_path / "junk.db").write_bytes(b"not a capture at all" * 100)
    for target in (tmp_path / "missing.db", tmp_path / "junk.db"):
        out = kvscope("check", str(target), "--json")
        assert out.returncode == 2 and out.stdout == "" and out.stderr.startswith("kvscope check: error: ")
        assert out.stderr.count("\n") == 1


@pytest.mark.parametrize("case", ["interrupted", "crashed", "incomplete", "ended-without-closing", "no-idle-check"])
def test_report_never_says_none_or_clean_when_it_cannot_know(tmp_path: Path, case: str) -> None:
    sample, sql, params, _, _ = CASES[case]
    out = kvscope("report", "leaks", str(variant(tmp_path, sample, sql, *params)))
    assert out.returncode == 0, out.stderr
    assert "leaks: none" not in out.stdout and "clean" not in out.stdout, out.stdout
    assert "verdict: inconclusive (kvscope check exits 3)" in out.stdout


def test_a_summary_capture_with_a_failed_check_says_what_it_cannot_show(tmp_path: Path) -> None:
    spec = RunSpec(
        engine=EngineConfig(pool=PoolConfig(page_size=4)),
        model=MODEL_PRESETS["tiny"],
        workload="multi-turn",
        num_requests=16,
        level="summary",
        capture=str(tmp_path / "s.db"),
        faults=(FaultSpec.parse("leak-tail:0.5"),),
        fault_seed=3,
    )
    with open(tmp_path / "out.txt", "w") as out:
        run(spec, out=out)
    text = kvscope("report", "leaks", str(tmp_path / "s.db")).stdout
    assert "leaks: none" not in text, text
    assert (
        "leaks: the leak check failed at step " in text
        and " tokens missing), but this capture is at level "
        "summary, so it has no slot indices to name the culprits: re-record at --level full"
        in text
    ), text
    assert "verdict: leak (kvscope check exits 1)" in text
    report = json.loads(kvscope("report", "leaks", str(tmp_path / "s.db"), "--json").stdout)
    assert report["verdict"] == "leak" and report["reason"].startswith("leak: the leak check failed at step ")
