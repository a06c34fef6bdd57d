"""Opening a capture checks its packed chunks against their columns in several statements; a writer
that commits a new chunk between them must not make a live capture read as damaged (it did: the
dashboard's live Overview died with KeyError (1, 22) under `make run`)."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from kvscope.telemetry.event_source import PackedEvents
from kvscope.telemetry.store import open_reader

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("live") / "shared-prefix-v6.db"
    shutil.copy(ROOT / "sample_runs" / "shared-prefix.db", path)
    upgrade = subprocess.run(
        [sys.executable, "-m", "kvscope", "upgrade", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=120,
    )
    assert upgrade.returncode == 0, upgrade.stderr
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode = WAL").fetchone()[0] == "wal"  # as a live writer keeps it
    conn.close()
    return path


def commit_another_chunk(path: Path) -> None:
    """What the writer does: one transaction adding a chunk row and all its columns (a copy of the
    last chunk, placed after it)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    run_id, chunk, first_seq, num_events = conn.execute(
        "SELECT run_id, chunk, first_seq, num_events FROM event_chunks ORDER BY first_seq DESC LIMIT 1"
    ).fetchone()
    names = [r[1] for r in conn.execute("PRAGMA table_info(event_chunks)")]
    row = dict(
        zip(
            names,
            conn.execute("SELECT * FROM event_chunks WHERE run_id = ? AND chunk = ?", (run_id, chunk)).fetchone(),
            strict=True,
        )
    )
    row.update(chunk=chunk + 1, first_seq=first_seq + num_events)
    conn.execute(
        f"INSERT INTO event_chunks ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values())
    )
    conn.execute(
        "INSERT INTO event_columns (run_id, chunk, name, dtype, data) "
        "SELECT run_id, chunk + 1, name, dtype, data FROM event_columns WHERE run_id = ? AND chunk = ?",
        (run_id, chunk),
    )
    conn.execute("COMMIT")
    conn.close()


def test_a_chunk_committed_during_the_check_does_not_read_as_damage(packed: Path, tmp_path: Path) -> None:
    path = tmp_path / "live.db"
    shutil.copy(packed, path)
    engine = open_reader(path)
    statements: list[str] = []

    @event.listens_for(engine, "after_cursor_execute")
    def _writer_commits_meanwhile(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)
        if "FROM event_chunks" in statement and sum("FROM event_chunks" in s for s in statements) == 1:
            commit_another_chunk(path)  # right after the chunk rows were read, before their columns

    try:
        PackedEvents(engine, str(path)).check_structure(with_columns=True)
    finally:
        engine.dispose()
    assert any("FROM event_columns" in s for s in statements), "the check read the columns after the chunks"
    grown = PackedEvents(open_reader(path), str(path))
    grown.check_structure(with_columns=True)  # the committed chunk is whole: the next open sees it, undamaged
