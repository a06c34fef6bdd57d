"""Copy a SQLite capture into a PostgreSQL database, table by table with COPY: the same runs on a server,
so the dashboard's pages and reads can be timed there on a capture too large to record twice.

    .venv/bin/python benchmarks/copy_capture.py CAPTURE URL [TABLE,TABLE...]

URL names an empty database (postgresql://USER:PASSWORD@HOST:PORT/DB). The schema is made as a writer
makes it (store.open_writer: every table and index of this kvscope's schema, the current version). A
CAPTURE of an older version (from 10 on) is copied as a writer would have upgraded it: its columns, the
later ones NULL, which its readers take as "not stored" (`kvscope upgrade URL` fills them). Rows go
in through binary COPY, a few tables at once, booleans as booleans; runs.id's sequence is moved past
the copied ids; then VACUUM ANALYZE, as autovacuum would have left a database written over hours.
Prints each table's rows and seconds. With TABLE,... only those tables are copied (they must be empty
there): the rest of a capture whose other tables are on the server already (its reports, stored after
its events). Not a kvscope feature: a capture on a server is written there by its recorder; this
exists to time the readers on a large one.
"""

from __future__ import annotations

import sqlite3
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BATCH_ROWS = 20_000
OLDEST_COPIED = 10  # NOTE: an older file's columns differ in more than added ones (version 5's NOT NULLs)
WORKERS = 3  # NOTE: tables copied at once: the bytes of event_columns wait on the server, the many small
# rows of tree_snapshots and requests on this process


def copy_capture(source: Path, url: str, only: Sequence[str] = ()) -> None:
    """`source`'s tables (`only` these, when given) into `url`, where they must be empty; COPYs run
    WORKERS tables at a time, each on its own connections."""
    from kvscope.telemetry import schema
    from kvscope.telemetry.store import open_writer, stored_version

    conn = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    try:
        version = conn.execute("SELECT value FROM kvscope_meta WHERE key = 'schema_version'").fetchone()
        present = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()
    if version is None or not OLDEST_COPIED <= int(version[0]) <= schema.SCHEMA_VERSION:
        raise SystemExit(
            f"{source}: schema version {version and version[0]}, not {OLDEST_COPIED}-{schema.SCHEMA_VERSION}"
        )
    tables = [t for t in _data_tables(schema) if t.name in present and (not only or t.name in only)]
    engine = open_writer(url)
    try:
        with engine.connect() as server:
            assert stored_version(server) == str(schema.SCHEMA_VERSION)
            if any(server.exec_driver_sql(f'SELECT 1 FROM "{t.name}" LIMIT 1').first() for t in tables):
                raise SystemExit(f"{url.split('@')[-1]}: a table to copy already holds rows; give an empty database")
        with ThreadPoolExecutor(WORKERS) as pool:
            for done in pool.map(lambda table: _copy_table(source, engine, table), tables):
                print(done, flush=True)
        with engine.begin() as server:
            server.exec_driver_sql("SELECT setval(pg_get_serial_sequence('runs', 'id'), (SELECT max(id) FROM runs))")
        start = time.perf_counter()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as server:
            server.exec_driver_sql("VACUUM ANALYZE")
        print(f"VACUUM ANALYZE: {time.perf_counter() - start:.1f} s", flush=True)
    finally:
        engine.dispose()


def _data_tables(schema: Any) -> list[Any]:
    return [t for t in schema.metadata.sorted_tables if t.name != schema.meta.name]


def _server_type(raw: Any, table: str, column: str) -> str:
    """The column's type on the server (its pg_type name: int8, int4 for runs.id, float8, ...)."""
    cursor = raw.cursor()
    cursor.execute(
        "SELECT t.typname FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid"
        " WHERE a.attrelid = %s::regclass AND a.attname = %s",
        (table, column),
    )
    return str(cursor.fetchone()[0])


def _copy_table(source: Path, engine: Any, table: Any) -> str:
    """Every row of `table` through one binary COPY, committed at the end (after a TRUNCATE in the same
    transaction: with wal_level=minimal the rows then skip the WAL); a line saying what was copied."""
    start = time.perf_counter()
    conn = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    raw = engine.raw_connection()
    try:
        have = {row[1] for row in conn.execute(f'PRAGMA table_info("{table.name}")')}
        names = [c.name for c in table.columns if c.name in have]
        columns = ", ".join(f'"{n}"' for n in names)
        types = [_server_type(raw, table.name, name) for name in names]
        bools = [i for i, name in enumerate(types) if name == "bool"]
        rows = conn.execute(f'SELECT {columns} FROM "{table.name}"')
        copied = 0
        cursor = raw.cursor()
        cursor.execute(f'TRUNCATE "{table.name}"')
        with cursor.copy(f'COPY "{table.name}" ({columns}) FROM STDIN (FORMAT BINARY)') as copy:
            copy.set_types(types)
            while batch := rows.fetchmany(BATCH_ROWS):
                for row in batch:
                    if bools:
                        row = list(row)
                        for i in bools:
                            row[i] = None if row[i] is None else bool(row[i])
                    copy.write_row(row)
                copied += len(batch)
        raw.commit()
    finally:
        raw.close()
        conn.close()
    return f"{table.name}: {copied:,} rows in {time.perf_counter() - start:.1f} s"


def main() -> None:
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    sys.path.insert(0, str(ROOT))
    source = Path(sys.argv[1])
    if not source.is_file():
        raise SystemExit(f"{source}: no such file")
    start = time.perf_counter()
    copy_capture(source, sys.argv[2], sys.argv[3].split(",") if len(sys.argv) == 4 else ())
    print(f"copied {source} in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
