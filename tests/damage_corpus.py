"""Damaged captures made at test time from a real, clean capture (sample_runs/shared-prefix.db): the
shapes a cut copy, a disk error, a hand edit or a half-written file leave. Every reader must say of each
that it is damaged (or not a capture) in one line, and never give a verdict read from what is left."""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

from kvscope.telemetry import schema

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "sample_runs" / "shared-prefix.db"  # NOTE: a finished run whose verdict is clean
TAIL_CUTS = (0.25, 0.5, 0.9)  # NOTE: shares of the file kept, cut at a page boundary
TAIL_BYTES_CUT = (1, 1000, 4096)  # NOTE: bytes cut off the end (one byte, inside the last page, one whole page)


def _cut(source: Path, path: Path, num_bytes: int) -> None:
    path.write_bytes(source.read_bytes()[:num_bytes])


def _edit(source: Path, path: Path, sql: str) -> None:
    shutil.copy(source, path)
    conn = sqlite3.connect(path)
    try:
        conn.executescript(sql)
    finally:
        conn.close()


def _drop_column(table: str, column: str) -> str:
    """SQL that rebuilds `table` without `column` (ALTER TABLE DROP COLUMN refuses a key or an indexed one)."""
    kept = ", ".join(f'"{c.name}"' for c in schema.metadata.tables[table].columns if c.name != column)
    return (
        f'CREATE TABLE kept AS SELECT {kept} FROM "{table}"; DROP TABLE "{table}"; '
        f'ALTER TABLE kept RENAME TO "{table}";'
    )


def _overwrite_page(source: Path, path: Path, table: str, fill: bytes) -> None:
    """The first leaf page of `table` overwritten with `fill` repeated (a disk error's shape)."""
    shutil.copy(source, path)
    conn = sqlite3.connect(path)
    try:
        page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
        (page,) = conn.execute(
            "SELECT min(pageno) FROM dbstat WHERE name = ? AND pagetype = 'leaf'", (table,)
        ).fetchone()
    finally:
        conn.close()
    with path.open("r+b") as fh:
        fh.seek(page_size * (page - 1))
        fh.write((fill * page_size)[:page_size])


def corpus(out: Path, source: Path = SOURCE) -> dict[str, Path]:
    """Every damaged shape, by name, written under `out`."""
    size = source.stat().st_size
    made: dict[str, Callable[[Path], None]] = {}
    for share in TAIL_CUTS:
        made[f"tail-kept-{int(share * 100)}pct"] = lambda p, s=share: _cut(source, p, int(size * s) // 4096 * 4096)
    for num_bytes in TAIL_BYTES_CUT:
        made[f"tail-cut-{num_bytes}B"] = lambda p, n=num_bytes: _cut(source, p, size - n)
    for table in schema.metadata.sorted_tables:
        for column in table.columns:
            made[f"no-column-{table.name}.{column.name}"] = lambda p, t=table.name, c=column.name: _edit(
                source, p, _drop_column(t, c)
            )
        if table.name != schema.reports.name:  # NOTE: reports is optional in every version (see schema.py)
            made[f"no-table-{table.name}"] = lambda p, t=table.name: _edit(source, p, f'DROP TABLE "{t}"')
    made["garbage-page-event_columns"] = lambda p: _overwrite_page(source, p, "event_columns", b"\xa5\x17")
    made["zeroed-page-leak_checks"] = lambda p: _overwrite_page(source, p, "leak_checks", b"\x00")
    made["zeroed-page-runs"] = lambda p: _overwrite_page(source, p, "runs", b"\x00")
    for value in ("abc", "0", ""):
        made[f"schema-version-{value or 'blank'}"] = lambda p, v=value: _edit(
            source, p, f"UPDATE kvscope_meta SET value = '{v}' WHERE key = 'schema_version'"
        )
    made["schema-version-row-gone"] = lambda p: _edit(source, p, "DELETE FROM kvscope_meta")
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, make in made.items():
        paths[name] = out / f"{name}.db"
        make(paths[name])
    return paths


def not_captures(out: Path) -> dict[str, Path]:
    """Files that are no capture at all: said so in one line (not 'damaged'), exit 2 too."""
    out.mkdir(parents=True, exist_ok=True)
    empty, text = out / "empty.db", out / "text.db"
    empty.write_bytes(b"")
    text.write_text("not a database\n" * 40)
    return {"empty": empty, "text": text}
