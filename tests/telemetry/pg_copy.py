"""Copy a SQLite capture into a server database, table by table, at the capture's own schema version
(its columns only, its stored version): the same recorded runs on both sides, so every read can be
compared between the two dialects, and `kvscope upgrade` can be run on the server copy."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlalchemy import Boolean, Column, MetaData, Table, create_engine

from kvscope.telemetry import schema
from kvscope.telemetry.store import server_url

BATCH_ROWS = 5_000


def copy_capture(source: Path, url: str) -> None:
    """`source`'s tables (those of schema.metadata it holds, with the columns it has) into the empty
    database at `url`."""
    engine = create_engine(server_url(url))
    conn = sqlite3.connect(source)
    try:
        present = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        tables = [t for t in schema.metadata.sorted_tables if t.name in present]
        copies = MetaData()
        with engine.begin() as server:
            for table in tables:
                have = [row[1] for row in conn.execute(f"PRAGMA table_info({table.name})")]
                columns = [c for c in table.columns if c.name in have]
                copy = Table(table.name, copies, *(Column(c.name, c.type, primary_key=c.primary_key) for c in columns))
                copy.create(server)
                _copy_rows(conn, server, copy, columns)
    finally:
        conn.close()
        engine.dispose()


def _copy_rows(conn: sqlite3.Connection, server: object, copy: Table, columns: list[Column]) -> None:
    flags = [isinstance(c.type, Boolean) for c in columns]
    names = ", ".join(f'"{c.name}"' for c in columns)
    cursor = conn.execute(f'SELECT {names} FROM "{copy.name}"')
    while rows := cursor.fetchmany(BATCH_ROWS):
        values = [
            {c.name: (bool(v) if flag and v is not None else v) for c, flag, v in zip(columns, flags, row, strict=True)}
            for row in rows
        ]
        server.execute(copy.insert(), values)  # type: ignore[attr-defined]
