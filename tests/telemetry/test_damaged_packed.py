"""A schema-6 capture whose packed event tables are gone, or whose chunks disagree with their
columns, is damaged: `check`, `report leaks`, `diff` and `runs` print one line and exit 2 (never
a verdict read from what is left, never a traceback)."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# NOTE: each case is SQL that damages a packed (schema 6) copy of sample_runs/shared-prefix.db (one chunk)
DAMAGE = {
    "tables-gone": "DROP TABLE event_chunks; DROP TABLE event_columns; DROP TABLE event_strings",
    "count-disagrees": "UPDATE event_chunks SET num_events = 1000",
    "unknown-dtype": "UPDATE event_columns SET dtype = '<c9' WHERE name = 'kind'",
    "short-column": "UPDATE event_columns SET data = substr(data, 1, 100) WHERE name = 'num_tokens'",
    "column-missing": "DELETE FROM event_columns WHERE name = 'aux'",
    "chunk-rows-gone": "DELETE FROM event_chunks",
    "seq-gap": "UPDATE event_chunks SET first_seq = 5",
}
# NOTE: damage only a read of the events can see (the slots' counts, the codes in use): the verbs that replay
# (with --replay: the sample's stored report, built while its events were whole, is read without them)
READ_DAMAGE = {
    "slots-short": "UPDATE event_columns SET data = substr(data, 1, 100) WHERE name = 'slots' AND length(data) > 100",
    "strings-gone": "DELETE FROM event_strings WHERE code > 3",
}


def kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, cwd=ROOT, check=False, timeout=120
    )


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("packed") / "shared-prefix-v6.db"
    shutil.copy(ROOT / "sample_runs" / "shared-prefix.db", path)
    assert kvscope("upgrade", str(path)).returncode == 0
    return path


def damaged_copy(packed: Path, tmp_path: Path, case: str) -> Path:
    path = tmp_path / f"{case}.db"
    shutil.copy(packed, path)
    conn = sqlite3.connect(path)
    with conn:
        conn.executescript({**DAMAGE, **READ_DAMAGE}[case])
    conn.close()
    return path


def test_the_packed_copy_reads_clean(packed: Path) -> None:
    out = kvscope("check", str(packed))
    assert out.returncode == 0 and "clean" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_packed_capture_is_one_line_and_exit_2(packed: Path, tmp_path: Path, case: str) -> None:
    path = damaged_copy(packed, tmp_path, case)
    for verb in (
        ["check", str(path)],
        ["report", "leaks", str(path)],
        ["diff", str(packed), str(path)],
        ["runs", str(path)],
    ):
        assert_one_damage_line(kvscope(*verb), path)


@pytest.mark.parametrize("case", sorted(READ_DAMAGE))
def test_damage_a_replay_meets_is_one_line_and_exit_2(packed: Path, tmp_path: Path, case: str) -> None:
    path = damaged_copy(packed, tmp_path, case)
    for verb in (["check", str(path), "--replay"], ["report", "leaks", str(path), "--replay"]):
        assert_one_damage_line(kvscope(*verb), path)


def assert_one_damage_line(out: subprocess.CompletedProcess[str], path: Path) -> None:
    assert out.returncode == 2, (out.args, out.stdout, out.stderr)
    assert out.stdout == "" and "Traceback" not in out.stderr, (out.args, out.stderr)
    assert out.stderr.count("\n") == 1 and f"{path}: damaged capture" in out.stderr, (out.args, out.stderr)
