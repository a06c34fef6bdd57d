"""The reading verbs (runs, check, report leaks, diff): the `--json` shapes docs/cli.md documents,
one `--run` selector on each, diff's hit-rate deltas, held/missing terms and config
differences, a run row with empty fields, and no torch loaded by any of them."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLEAN = "sample_runs/shared-prefix.db"
LEAKY = "sample_runs/leaky.db"
# runs a verb through the console script's entry point, then says whether torch got loaded
NO_TORCH = (
    "import sys\nfrom kvscope.__main__ import main\ncode = main(sys.argv[1:])\nsys.stdout.flush()\n"
    "print('torch loaded:', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)\n"
)


def kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )


def as_json(*args: str) -> Any:
    out = kvscope(*args, "--json")
    assert out.returncode in (0, 1, 3), out.stderr
    return json.loads(out.stdout)


def two_runs(tmp_path: Path) -> Path:
    """One capture holding the clean sample's run twice (ids 1 and 2), the second with a failed check."""
    path = tmp_path / "two.db"
    shutil.copy(ROOT / CLEAN, path)
    conn = sqlite3.connect(path)
    with conn:
        for table in ("runs", "usage", "leak_checks", "events", "requests"):
            columns = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
            names = ", ".join(columns)
            picked = ", ".join("2" if c in ("id", "run_id") else c for c in columns)
            conn.execute(f"INSERT INTO {table} ({names}) SELECT {picked} FROM {table}")
        conn.execute(
            "UPDATE leak_checks SET ok = 0, available = available - 5, message = 'x: 5 tokens missing' "
            "WHERE run_id = 2 AND pool = 'full'"
        )
    conn.close()
    return path


def test_runs_json(tmp_path: Path) -> None:
    shape = as_json("runs", str(two_runs(tmp_path)))
    assert list(shape) == ["capture", "runs"] and [r["id"] for r in shape["runs"]] == [1, 2]
    run = shape["runs"][0]
    assert list(run) == [
        "id",
        "label",
        "status",
        "level",
        "started_at",
        "started_at_unix",
        "seconds",
        "error",
        "event_bytes",
        "retention",
    ]
    assert run["event_bytes"] >= 0 and run["retention"] is None  # NOTE: a run without a bound drops nothing
    assert run["status"] == "finished" and run["level"] == "full" and run["label"] == "shared-prefix"
    assert run["started_at"].endswith("Z") and isinstance(run["started_at_unix"], float)
    assert run["seconds"] > 0 and run["error"] is None
    only = as_json("runs", str(tmp_path / "two.db"), "--run", "2")
    assert [r["id"] for r in only["runs"]] == [2]


def test_runs_on_a_row_with_empty_fields(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    shutil.copy(ROOT / CLEAN, path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(
            "UPDATE runs SET started_at = '', ended_at = NULL, heartbeat_at = NULL, level = '', label = '', "
            "host = NULL, pid = NULL"
        )
    conn.close()
    out = kvscope("runs", str(path))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    run = as_json("runs", str(path))["runs"][0]
    kib = f"{run['event_bytes'] / 1024:.1f}"  # NOTE: the sample's own size (make samples rewrites it)
    assert out.stdout.splitlines()[1].split() == ["1", "finished", "-", "-", "-", kib, "KiB", "-"]
    assert run["started_at"] is None and run["seconds"] is None and run["level"] is None


def test_check_json_and_run_selector(tmp_path: Path) -> None:
    path = str(two_runs(tmp_path))
    first, second = as_json("check", path, "--run", "1"), as_json("check", path)
    assert list(first) == ["capture", "run", "status", "verdict", "exit_code", "reason", "source"]
    assert (first["run"], first["verdict"], first["exit_code"]) == (1, "clean", 0)
    assert (second["run"], second["verdict"], second["exit_code"]) == (2, "leak", 1)
    assert kvscope("check", path, "--run", "1").returncode == 0 and kvscope("check", path).returncode == 1
    missing = kvscope("check", path, "--run", "7")
    assert missing.returncode == 2 and "no run 7 (runs: 1, 2)" in missing.stderr


def test_report_json_carries_the_verdict() -> None:
    report = as_json("report", "leaks", LEAKY)
    assert report["verdict"] == "leak" and report["reason"].startswith("leak: orphaned: ")
    assert {"capture", "run_id", "level", "status", "leaks", "first_failure_step", "onset_step"} <= set(report)
    clean = as_json("report", "leaks", CLEAN, "--run", "1")
    assert clean["verdict"] == "clean" and clean["leaks"] == []


def test_diff_json_fills_every_delta_and_compares_configs() -> None:
    result = as_json("diff", CLEAN, LEAKY)
    assert list(result) == ["a", "b", "deltas", "config_differences"]
    for side, verdict in ((result["a"], "clean"), (result["b"], "leak")):
        assert {
            "capture",
            "run",
            "status",
            "level",
            "verdict",
            "reason",
            "metrics",
            "last_check",
            "events",
            "config",
        } <= set(side)
        assert side["verdict"] == verdict
    a, b, deltas = result["a"], result["b"], result["deltas"]
    rate = "hit rate (token-weighted)"
    assert deltas["metrics"][rate] == pytest.approx(b["metrics"][rate] - a["metrics"][rate])
    assert deltas["metrics"][rate] != 0
    full = b["last_check"]["full"]
    assert full["missing"] == full["total"] - sum(
        full[t] for t in ("available", "evictable", "protected", "held", "uncached")
    )
    assert full["missing"] > 0 and deltas["missing"]["full"] == full["missing"] - a["last_check"]["full"]["missing"]
    assert result["config_differences"]["engine.pool.kv_size_tokens"] == {"a": 4096, "b": 2048}
    assert "clock.wall_s" not in result["config_differences"]


def test_diff_text_and_the_run_selector(tmp_path: Path) -> None:
    out = kvscope("diff", CLEAN, LEAKY)
    assert out.returncode == 0, out.stderr
    rows = {line.split("  ")[0].strip(): line for line in out.stdout.splitlines()}
    assert rows["hit rate (token-weighted)"].rstrip().endswith("pp")
    assert "/40 of 2048" in rows["last check [full]"] and rows["last check [full]"].endswith("+40 missing")
    assert "engine.pool.kv_size_tokens  4096 -> 2048" in out.stdout
    path = str(two_runs(tmp_path))
    same = as_json("diff", path, path, "--run", "1", "--run", "2")
    assert (same["a"]["run"], same["b"]["run"]) == (1, 2) and same["config_differences"] == {}
    assert (same["a"]["verdict"], same["b"]["verdict"]) == ("clean", "leak")
    assert same["deltas"]["missing"]["full"] == 5
    assert kvscope("diff", path, path, "--run", "1", "--run", "2", "--run", "3").returncode == 2


@pytest.mark.parametrize(
    "args",
    [("runs", CLEAN), ("check", LEAKY), ("report", "leaks", LEAKY), ("diff", CLEAN, LEAKY), ("check", CLEAN, "--json")],
    ids=lambda a: "-".join(a[:2]),
)
def test_reading_verbs_never_load_torch(args: tuple[str, ...]) -> None:
    out = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode in (0, 1), out.stderr
    assert out.stderr.splitlines()[-1] == "torch loaded: False"


def test_runs_on_a_running_row_with_empty_heartbeat_and_pid(tmp_path: Path) -> None:
    path = tmp_path / "running.db"
    shutil.copy(ROOT / CLEAN, path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE runs SET status = 'running', heartbeat_at = '', pid = '', ended_at = NULL")
    conn.close()
    out = kvscope("runs", str(path))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.splitlines()[1].split()[:2] == ["1", "running"]
