"""Opening captures: a writer engine (creates the schema) and a read-only reader engine.

The store takes any SQLAlchemy URL; a plain path means a SQLite file. Only the pragmas are
SQLite-specific: WAL so readers read while the engine writes, a busy timeout, and
synchronous=NORMAL. Readers open SQLite files with `mode=ro` and can never write.

Bad input (a missing path, a file that is not SQLite, a truncated file, a SQLite file that
is not a kvscope capture, a newer schema version) raises CaptureError with one line naming
the file and the problem; nothing is written to the file. A writer brings a file of an older
readable version up to the current one (see schema.py, versions).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, Table, create_engine, event, inspect, select, text, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.schema import CreateColumn

from kvscope.telemetry import schema

SQLITE_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_MS = 10_000


class CaptureError(Exception):
    """A capture cannot be used; the message is one line naming the file and the problem."""


def is_url(target: str | Path) -> bool:
    return "://" in str(target)


def _sqlite_pragmas(engine: Engine, read_only: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if not read_only:
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA cache_size = -65536")  # 64 MiB page cache for bulk inserts
        cursor.close()


def check_sqlite_file(path: Path) -> None:
    """Cheap structural checks before SQLite sees the file: exists, magic, not truncated."""
    if not path.exists():
        raise CaptureError(f"{path}: no such file")
    if not path.is_file():
        raise CaptureError(f"{path}: not a file")
    with path.open("rb") as fh:
        header = fh.read(100)
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
        raise CaptureError(f"{path}: not a kvscope capture (not a SQLite database)")
    page_size = struct.unpack(">H", header[16:18])[0] or 65536
    page_size = 65536 if page_size == 1 else page_size
    num_pages = struct.unpack(">I", header[28:32])[0]
    if num_pages and path.stat().st_size < page_size * num_pages:
        raise CaptureError(
            f"{path}: truncated capture ({path.stat().st_size} bytes, the header says {page_size * num_pages})"
        )


def check_schema(engine: Engine, name: str) -> int:
    """The file's schema version, checked to be one this kvscope reads."""
    try:
        tables = set(inspect(engine).get_table_names())
        if schema.meta.name not in tables:
            raise CaptureError(f"{name}: not a kvscope capture (no {schema.meta.name} table)")
        with engine.connect() as conn:
            found = stored_version(conn)
    except SQLAlchemyError as err:
        raise CaptureError(f"{name}: unreadable capture ({_first_line(err)})") from err
    if found is None or not found.isdigit() or int(found) < schema.OLDEST_READABLE_VERSION:
        raise CaptureError(f"{name}: not a kvscope capture (no schema version)")
    if int(found) > schema.SCHEMA_VERSION:
        raise CaptureError(
            f"{name}: written by a newer kvscope (schema version {found}; this one reads up to "
            f"{schema.SCHEMA_VERSION}); upgrade kvscope to read it"
        )
    missing = {t.name for t in schema.metadata.sorted_tables} - {t.name for t in schema.OPTIONAL_TABLES} - tables
    if missing:
        raise CaptureError(f"{name}: damaged capture (missing tables {sorted(missing)})")
    return int(found)


def stored_version(conn: Connection) -> str | None:
    """The schema_version stored in the file (None when there is none)."""
    found = conn.execute(select(schema.meta.c.value).where(schema.meta.c.key == "schema_version")).scalar_one_or_none()
    return None if found is None else str(found)


def _upgrade(engine: Engine, version: int) -> None:
    """Bring a file of an older readable version up to SCHEMA_VERSION: add the later columns
    (NULL in every existing row), then store the new version, in one transaction."""
    preparer = engine.dialect.identifier_preparer
    with engine.begin() as conn:
        for column in schema.added_after(version):
            ddl = CreateColumn(column).compile(dialect=engine.dialect)
            conn.execute(text(f"ALTER TABLE {preparer.format_table(column.table)} ADD COLUMN {ddl}"))
        conn.execute(update(schema.meta).where(schema.meta.c.key == "schema_version")
                     .values(value=str(schema.SCHEMA_VERSION)))


def _first_line(err: Exception) -> str:
    text = str(getattr(err, "orig", None) or err)
    return text.splitlines()[0] if text else type(err).__name__


def open_reader(target: str | Path) -> Engine:
    """A read-only engine on a capture, checked to be one we can read."""
    if is_url(target):
        engine = create_engine(str(target))
        check_schema(engine, str(target))
        return engine
    path = Path(target)
    check_sqlite_file(path)
    uri = f"file:{path.resolve()}?mode=ro"
    engine = create_engine("sqlite://", creator=lambda: _sqlite_ro_connect(uri))
    _sqlite_pragmas(engine, read_only=True)
    try:
        check_schema(engine, str(path))
    except CaptureError:
        engine.dispose()
        raise
    return engine


def _sqlite_ro_connect(uri: str) -> Any:
    import sqlite3

    return sqlite3.connect(uri, uri=True, check_same_thread=False)


def open_writer(target: str | Path) -> Engine:
    """An engine that creates the schema if needed; refuses files it must not write to."""
    if is_url(target):
        engine = create_engine(str(target))
        name = str(target)
    else:
        path = Path(target)
        if path.exists() and path.stat().st_size:
            open_reader(path).dispose()  # validate read-only before any pragma touches the file
        path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False})
        _sqlite_pragmas(engine, read_only=False)
        name = str(path)
    try:
        tables = set(inspect(engine).get_table_names())
    except SQLAlchemyError as err:
        raise CaptureError(f"{name}: unreadable capture ({_first_line(err)})") from err
    if tables:
        version = check_schema(engine, name)
        if version < schema.SCHEMA_VERSION:
            _upgrade(engine, version)
        schema.metadata.create_all(engine, tables=[t for t in schema.OPTIONAL_TABLES if t.name not in tables])
    else:
        schema.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(schema.meta.insert(), [{"key": "schema_version", "value": str(schema.SCHEMA_VERSION)}])
    return engine


def save_report(target: str | Path, run_id: int, kind: str, through_seq: int, producer: str, body: str) -> None:
    """Store (or replace) a derived report of a run in the capture."""
    import time

    engine = open_writer(target)
    try:
        table = schema.reports
        with engine.begin() as conn:
            conn.execute(table.delete().where(table.c.run_id == run_id, table.c.kind == kind))
            conn.execute(table.insert(), [{"run_id": run_id, "kind": kind, "through_seq": through_seq,
                                           "built_at": time.time(), "producer": producer, "body": body}])
    except SQLAlchemyError as err:
        raise CaptureError(f"{target}: cannot store the {kind} report ({_first_line(err)})") from err
    finally:
        engine.dispose()


class BulkInsert:
    """executemany of positional rows through the driver, in the dialect's paramstyle."""

    def __init__(self, engine: Engine, table: Table, columns: Sequence[str]) -> None:
        stmt = table.insert().values({c: None for c in columns})
        compiled = stmt.compile(dialect=engine.dialect)
        self.sql = str(compiled)
        self.positional = bool(compiled.positional)
        order = list(compiled.positiontup or []) if self.positional else list(columns)
        self.columns = list(columns)
        self.index = [self.columns.index(name) for name in order]

    def params(self, rows: Sequence[Sequence[Any]]) -> list[Any]:
        if self.positional:
            if self.index == list(range(len(self.columns))):
                return list(rows)
            return [tuple(row[i] for i in self.index) for row in rows]
        return [dict(zip(self.columns, row, strict=True)) for row in rows]
