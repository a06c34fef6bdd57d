"""Opening captures: a writer engine (creates the schema) and a read-only reader engine.

NOTE: what a target names
    "scheme://..."     a SQLAlchemy URL, for writers and readers alike; a sqlite URL naming a
                       file (sqlite:////abs/c.db) means that file, opened as a path is
    anything else      a SQLite file path, verbatim ("what?.db", "a%20b.db", "run#1.db");
                       a Path object is always a path, and no URL ever goes through Path()
SQLite files are opened through percent-encoded `file:` URIs, so no character of a name is
read as URI syntax. Only the pragmas are SQLite-specific: WAL while a writer writes (readers
read beside it), a busy timeout, synchronous=NORMAL, and every write transaction BEGIN
IMMEDIATE (two writers queue on the busy timeout instead of failing on a lock upgrade).
A `postgresql://` URL opens through psycopg 3 (DEFAULT_DRIVERS); there every writer creates or
upgrades the schema under a transaction-scoped advisory lock (SCHEMA_LOCK_KEY), so writers starting
together queue instead of racing on the catalog.

NOTE: what a reader guarantees
    - it never writes, and never creates a file (a sqlite URL to a missing file is refused)
    - a file in rollback (DELETE) mode, as a writer leaves it when it closes, is read with no
      -wal/-shm beside it; on read-only media SQLite's immutable mode reads a WAL-mode file
      whose log is empty (read_mode)
    - SQLite itself judges a file: quick_check at open below QUICK_CHECK_MAX_BYTES, and any
      read that meets a damaged page raises CaptureError ("damaged capture (...)"), not a
      DatabaseError
Bad input (a missing path, a directory or device, a file that is not SQLite, an empty or
damaged file, a SQLite file that is not a kvscope capture, a newer schema version, a server
that refuses the connection) raises CaptureError with one line naming the target and the
problem; nothing is written to the file. A writer creates the schema in one transaction (a
process killed meanwhile leaves an empty file, which the next writer reuses) and brings a
file of an older readable version up to the current one (see schema.py, versions).
"""

from __future__ import annotations

import os
import re
import sqlite3
import struct
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import (
    URL,
    ColumnElement,
    Connection,
    Engine,
    Select,
    Table,
    create_engine,
    event,
    func,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import QueuePool
from sqlalchemy.schema import CreateColumn, CreateIndex

from kvscope.telemetry import schema
from kvscope.telemetry.sqlite_files import (
    BUSY_TIMEOUT_MS,
    execute_when_free,
    file_uri,
    first_line,
    read_head,
    settle_file,
)
from kvscope.telemetry.writer import Statement

SQLITE_MAGIC = b"SQLite format 3\x00"
QUICK_CHECK_MAX_BYTES = 64 << 20  # ~0.3 s of quick_check; larger files are checked by the reads themselves
SCHEMA_ATTEMPTS = 3  # a server database: creating the schema again after a concurrent creator won
# NOTE: a URL scheme without a driver names the maintained one: PostgreSQL through psycopg 3
DEFAULT_DRIVERS = {"postgresql": "postgresql+psycopg", "postgres": "postgresql+psycopg"}
# NOTE: the PostgreSQL advisory lock (transaction-scoped) every writer holds while it creates or upgrades the
# schema: concurrent writers on one new database queue on it, the first creates, the others find the tables
SCHEMA_LOCK_KEY = 0x6B7673636F7065  # "kvscope"
# NOTE: a reader's pool: a connection is lent to one thread at a time and never closed while lent (the
# dashboard reads from a new thread on every rerun of every tab); past the idle ones kept, more open as needed
READER_IDLE_CONNECTIONS = 4
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# NOTE: SQLite primary result codes (extended code & 0xff) a reader reports as one line
_DAMAGED_CODES = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB
_UNREADABLE_CODES = {10, 14}  # SQLITE_IOERR, SQLITE_CANTOPEN
SQLITE_READONLY_ROLLBACK = 776  # a read-only connection met a hot journal

ReadMode = Literal["ro", "immutable", "wal-unreadable"]


class CaptureError(Exception):
    """A capture cannot be used; the message is one line naming the file and the problem."""


class EmptyCaptureError(CaptureError):
    """A capture with no schema yet (a writer stopped while creating it): readers refuse it,
    writers reuse it."""


# -- what a target names ---------------------------------------------------------------------


def is_url(target: str | Path) -> bool:
    """A SQLAlchemy URL (`scheme://...`); a Path object never is one."""
    return isinstance(target, str) and _URL.match(target) is not None


def file_of(target: str | Path) -> Path | None:
    """The SQLite file a target names (a path, or a sqlite URL's file); None for a server URL
    (or a sqlite URL with options or no file, handed to SQLAlchemy as it is)."""
    if not is_url(target):
        return Path(target)
    url = _parse_url(str(target))
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") and not url.query:
        return Path(str(url.database))
    return None


def display_name(target: str | Path) -> str:
    """The target as messages name it (a URL without its password)."""
    return _parse_url(str(target)).render_as_string(hide_password=True) if is_url(target) else str(target)


def link_name(target: str | Path) -> str:
    """The target as a link or a page may carry it: a URL with no password at all (not even
    hidden: a link is matched to the capture the server was given by this name, and the password
    stays where the server holds it); a path as it is."""
    if not is_url(target):
        return str(target)
    url = _parse_url(str(target))
    bare = URL.create(url.drivername, url.username, None, url.host, url.port, url.database, url.query)
    return bare.render_as_string(hide_password=False)


def server_url(target: str) -> URL:
    """A database URL as kvscope opens it: `postgresql://` (and `postgres://`) through psycopg 3."""
    url = _parse_url(target)
    return url.set(drivername=DEFAULT_DRIVERS.get(url.drivername, url.drivername))


def _parse_url(target: str) -> URL:
    try:
        return make_url(target)
    except SQLAlchemyError as err:
        raise CaptureError(f"{target}: not a database URL ({first_line(err)})") from err


# -- checks on a SQLite file ------------------------------------------------------------------


def check_sqlite_file(path: Path, *, allow_empty: bool = False) -> None:
    """Checks before SQLite sees the file: a regular file that starts like a SQLite database
    (a zero-byte file is an empty capture: refused unless `allow_empty`)."""
    if not path.exists():
        raise CaptureError(f"{path}: no such file")
    if path.is_dir():
        raise CaptureError(f"{path}: is a directory, not a capture file")
    if not path.is_file():
        raise CaptureError(f"{path}: not a regular file (a capture is a SQLite file)")
    if path.stat().st_size == 0:
        if allow_empty:
            return
        raise EmptyCaptureError(f"{path}: empty capture (no run recorded in it yet)")
    header = read_head(path, 100)
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
        raise CaptureError(f"{path}: not a kvscope capture (not a SQLite database)")
    cut = _truncation(path, header)
    if cut:
        raise CaptureError(f"{path}: damaged capture ({cut})")


def _truncation(path: Path, header: bytes) -> str | None:
    """'truncated: N bytes, the header says M' when the file is shorter than the pages its header
    counts and no log beside it holds the rest; None otherwise (a header whose count SQLite itself
    would not trust says nothing). NOTE: reads the header only, so it costs the same on any size."""
    for log in (Path(f"{path}-wal"), Path(f"{path}-journal")):
        if log.exists() and log.stat().st_size:
            return None  # NOTE: a log beside the file may hold pages a checkpoint or a rollback writes back
    page_size = struct.unpack(">H", header[16:18])[0]
    page_size = 65536 if page_size == 1 else page_size
    num_pages = struct.unpack(">I", header[28:32])[0]
    change_counter, valid_for = header[24:28], header[92:96]
    if num_pages == 0 or change_counter != valid_for:
        return None
    size, expected = path.stat().st_size, page_size * num_pages
    return f"truncated: {size} bytes, the header says {expected}" if size < expected else None


def read_mode(dir_writable: bool, wal_mode: bool, wal_bytes: int, has_shm: bool) -> ReadMode:
    """How a reader opens a SQLite file.

    'ro': SQLite's read-only mode. It needs nothing beside a file in rollback mode; beside a
    WAL-mode file it needs the -shm (and -wal) to exist or to be creatable.
    'immutable': the file alone, no locks: for a WAL-mode file in a directory we cannot write
    (read-only media) whose log holds nothing. SQLite's immutable mode ignores the log.
    'wal-unreadable': committed data sits in a log SQLite cannot read here (a -wal without its
    -shm, in a directory we cannot write).
    """
    if dir_writable or not wal_mode:
        return "ro"
    if wal_bytes == 0:
        return "immutable"
    return "ro" if has_shm else "wal-unreadable"


def _read_mode_of(path: Path) -> ReadMode:
    header = read_head(path, 20)
    wal = Path(f"{path}-wal")
    return read_mode(
        dir_writable=os.access(path.parent, os.W_OK),
        wal_mode=header[18:20] == b"\x02\x02",
        wal_bytes=wal.stat().st_size if wal.exists() else 0,
        has_shm=Path(f"{path}-shm").exists(),
    )


def _damage_detail(path: Path, reason: str) -> str:
    """SQLite's reason, and the sizes when the file is shorter than its header says (and no
    log holds the rest)."""
    cut = _truncation(path, read_head(path, 100))
    return f"{cut}; {reason}" if cut else reason


def _sqlite_error_of(err: BaseException) -> tuple[str, int] | None:
    """(message, primary result code) of a sqlite3 error a reader reports as one line."""
    if not isinstance(err, sqlite3.Error):
        return None
    code = (getattr(err, "sqlite_errorcode", 0) or 0) & 0xFF
    if code in _DAMAGED_CODES or code in _UNREADABLE_CODES:
        return first_line(err), code
    return None


def _capture_error_for(name: str, path: Path | None, err: BaseException) -> CaptureError | None:
    found = _sqlite_error_of(err)
    if found is None:
        return None
    reason, code = found
    if code in _DAMAGED_CODES:
        return CaptureError(f"{name}: damaged capture ({_damage_detail(path, reason) if path else reason})")
    return CaptureError(f"{name}: unreadable capture ({reason})")


def _report_damage(engine: Engine, name: str, path: Path | None) -> None:
    """Reads through `engine` that meet a damaged or unreadable file raise one-line CaptureErrors."""

    @event.listens_for(engine, "handle_error")
    def _on_error(ctx: ExceptionContext) -> None:
        replacement = _capture_error_for(name, path, ctx.original_exception)
        if replacement is not None:
            raise replacement from ctx.original_exception


def driver_rows(
    engine: Engine, stmt: Any, capture_name: str, batch_rows: int = 100_000, *, binary: bool = False
) -> Iterator[list[tuple]]:
    """The rows of a SELECT read through the driver itself, in batches: plain tuples, without
    SQLAlchemy's row objects (several times faster on large reads); a damaged or unreadable
    file raises the one-line CaptureError, as reads through SQLAlchemy do. `binary`: a server
    database sends the rows in its binary format (ignored on SQLite).
    NOTE: binary is for reads of bytea (event columns): in the text format PostgreSQL sends a bytea
    as hex digits, twice its bytes, which the driver then decodes (3-4x the time of the binary read).
    Only for reads whose columns all have binary loaders (integers, floats, text, bytea): an unknown
    type (a bare literal) would come back as bytes."""
    compiled = stmt.compile(dialect=engine.dialect, compile_kwargs={"render_postcompile": True})
    params = [compiled.params[k] for k in compiled.positiontup or []] if compiled.positional else compiled.params
    with engine.connect() as conn:
        driver = conn.connection.driver_connection
        server = binary and engine.dialect.name == "postgresql"
        cursor = driver.cursor(binary=True) if server else driver.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(str(compiled), params)
            while rows := cursor.fetchmany(batch_rows):
                yield rows
        except Exception as err:
            reraise_read_error(capture_name, err)
            raise
        finally:
            cursor.close()


def distinct_in_key(column: Any, *where: ColumnElement[bool]) -> Select[Any]:
    """The distinct values of `column`, ascending, among the rows `where` selects, read by hopping
    from one value to the next through an index whose key leads with `where`'s equalities and then
    `column` (a recursive query: one index seek per value). NOTE: SELECT DISTINCT reads every row
    of the range instead: 17 million tree-snapshot rows for 852 snapshot steps (16 s), 3.4 million
    event strings for one run id (1.3 s) on a 100-million-event capture."""
    hops = select(func.min(column).label("value")).where(*where).cte(f"hops_{column.name}", recursive=True)
    following = select(func.min(column)).where(*where, column > hops.c.value).scalar_subquery()
    hops = hops.union_all(select(following).where(hops.c.value.is_not(None)))
    return select(hops.c.value).where(hops.c.value.is_not(None))


def reraise_read_error(capture_name: str, err: BaseException) -> None:
    """For reads through the driver itself (not SQLAlchemy): raise the one-line CaptureError
    for a damaged or unreadable file; return for any other error (the caller re-raises)."""
    path = file_of(capture_name)
    replacement = _capture_error_for(display_name(capture_name), path, err)
    if replacement is not None:
        raise replacement from err


def check_schema(conn: Connection, name: str) -> int:
    """The file's schema version, checked to be one this kvscope reads."""
    try:
        tables = set(inspect(conn).get_table_names())
        if not tables:
            raise EmptyCaptureError(f"{name}: empty capture (no run recorded in it yet)")
        if schema.meta.name not in tables:
            kept = sorted(tables & {t.name for t in schema.metadata.sorted_tables})
            if kept:  # NOTE: kvscope's other tables without the one that says which schema wrote them
                raise CaptureError(f"{name}: damaged capture (no {schema.meta.name} table beside {kept})")
            raise CaptureError(f"{name}: not a kvscope capture (no {schema.meta.name} table)")
        _check_columns(conn, name, schema.OLDEST_READABLE_VERSION, [schema.meta])
        found = stored_version(conn)
    except SQLAlchemyError as err:
        raise CaptureError(f"{name}: unreadable capture ({first_line(err)})") from err
    if found is None:
        raise CaptureError(f"{name}: damaged capture (no schema version in {schema.meta.name})")
    if not found.isdigit() or int(found) < schema.OLDEST_READABLE_VERSION:
        raise CaptureError(f"{name}: damaged capture (schema version {found!r} is none kvscope ever wrote)")
    if int(found) > schema.SCHEMA_VERSION:
        raise CaptureError(
            f"{name}: written by a newer kvscope (schema version {found}; this one reads up to "
            f"{schema.SCHEMA_VERSION}); upgrade kvscope to read it"
        )
    optional = {t.name for t in schema.optional_tables(int(found))}
    missing = {t.name for t in schema.metadata.sorted_tables} - optional - tables
    if missing:
        raise CaptureError(f"{name}: damaged capture (missing tables {sorted(missing)})")
    _check_columns(conn, name, int(found), [t for t in schema.metadata.sorted_tables if t.name in tables])
    return int(found)


def _check_columns(conn: Connection, name: str, version: int, tables: Sequence[Table]) -> None:
    """Each of `tables` has every column a file of `version` holds (one PRAGMA table_info per table:
    the same cost on any size); a missing one is damage, not a reader's traceback."""
    inspector = inspect(conn)
    for table in tables:
        try:
            found = {c["name"] for c in inspector.get_columns(table.name)}
        except SQLAlchemyError as err:
            raise CaptureError(f"{name}: damaged capture (table {table.name}: {first_line(err)})") from err
        lacking = [c.name for c in table.columns if schema.since_version(c) <= version and c.name not in found]
        if lacking:
            raise CaptureError(f"{name}: damaged capture (table {table.name} lacks columns {lacking})")


def quick_check(conn: Connection, name: str) -> None:
    """SQLite's own check of every page of the file (PRAGMA quick_check; about 2.7 s per GB): a
    damaged page anywhere is one CaptureError line."""
    found = conn.exec_driver_sql("PRAGMA quick_check(1)").scalar_one_or_none()
    if found != "ok":
        # NOTE: SQLite heads the first problem with "*** in database main ***"
        lines = [line for line in str(found).splitlines() if line.strip() and not line.startswith("***")]
        raise CaptureError(f"{name}: damaged capture (quick_check: {lines[0] if lines else found})")


def stored_version(conn: Connection) -> str | None:
    """The schema_version stored in the file (None when there is none)."""
    found = conn.execute(select(schema.meta.c.value).where(schema.meta.c.key == "schema_version")).scalar_one_or_none()
    return None if found is None else str(found)


# -- readers ----------------------------------------------------------------------------------


def open_reader(target: str | Path) -> Engine:
    """A read-only engine on a capture, checked to be one we can read."""
    path = file_of(target)
    name = display_name(target)
    if path is None:
        engine = _server_engine(str(target), name)
    else:
        check_sqlite_file(path)
        engine = _sqlite_reader_engine(path, name, _read_mode_of(path))
    try:
        if path is not None and _refused_for_a_hot_journal(engine):
            engine.dispose()
            engine = _sqlite_reader_engine(path, name, "immutable")
        with engine.connect() as conn:
            check_schema(conn, name)
            if path is not None and path.stat().st_size <= QUICK_CHECK_MAX_BYTES:
                quick_check(conn, name)
    except BaseException:
        engine.dispose()
        raise
    return engine


@contextmanager
def consistent_reads(engine: Engine) -> Iterator[Connection]:
    """A connection whose reads all see one committed state of the capture.

    NOTE: a live capture's writer commits between any two statements; SQLite's driver starts no
    transaction for a SELECT, so each statement would see a newer file (a chunk row read first and its
    columns read after would disagree, and a live capture would read as damaged). An explicit BEGIN
    (SQLite) or REPEATABLE READ (a server database) holds one snapshot until the connection ends."""
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            conn.exec_driver_sql("BEGIN")
            yield conn
    else:
        with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
            yield conn


def _sqlite_reader_engine(path: Path, name: str, mode: ReadMode) -> Engine:
    if mode == "wal-unreadable":
        raise CaptureError(
            f"{name}: unreadable here: its log {path}-wal holds committed data that SQLite cannot read "
            "in a directory it cannot write; copy both files to a writable directory"
        )
    uri = file_uri(path, mode="ro", **({"immutable": "1"} if mode == "immutable" else {}))
    engine = create_engine(
        URL.create("sqlite", database=str(path)),
        poolclass=QueuePool,
        pool_size=READER_IDLE_CONNECTIONS,
        max_overflow=-1,
        creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False),
    )
    _on_connect(engine, f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    _report_damage(engine, name, path)
    return engine


def _refused_for_a_hot_journal(engine: Engine) -> bool:
    """Whether SQLite refuses a read-only open for a hot -journal, which only a writer may roll
    back. A kvscope writer leaves one only when killed while switching the journal mode (it
    changes the header alone), so the file itself holds every committed row: read it as it is."""
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar_one()
    except DBAPIError as err:
        return getattr(err.orig, "sqlite_errorcode", None) == SQLITE_READONLY_ROLLBACK
    return False


def _server_engine(url: str, name: str) -> Engine:
    """An engine on a server database (or a sqlite URL with options), connected once so that a
    missing driver or a refused connection is one line here."""
    try:
        # NOTE: pre-ping: a connection the server dropped (a restart) is replaced, not handed to a read
        engine = create_engine(server_url(url), pool_pre_ping=True)
        with engine.connect():
            pass
    except (SQLAlchemyError, ImportError) as err:
        raise CaptureError(f"{name}: cannot open the database ({first_line(err)})") from err
    _report_damage(engine, name, None)
    return engine


def _on_connect(engine: Engine, *statements: str, autocommit: bool = False) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        if autocommit:
            dbapi_conn.isolation_level = None  # NOTE: transactions are begun by _begin_immediate
        cursor = dbapi_conn.cursor()
        for statement in statements:
            execute_when_free(cursor, statement)
        cursor.close()


# -- writers ----------------------------------------------------------------------------------


def open_writer(target: str | Path) -> Engine:
    """An engine that creates the schema if needed; refuses files it must not write to."""
    path = file_of(target)
    name = display_name(target)
    if path is None:
        engine = _server_engine(str(target), name)
    else:
        if path.exists():
            check_sqlite_file(path, allow_empty=True)
            if path.stat().st_size:
                _validate_existing(path)  # read-only, before any pragma touches the file
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CaptureError(f"{name}: cannot create its directory ({err.strerror})") from err
        engine = _sqlite_writer_engine(path)
    try:
        _ensure_schema(engine, name)
    except BaseException:
        engine.dispose()
        raise
    return engine


def _validate_existing(path: Path) -> None:
    """Refuse a file a reader would refuse, except an empty one (a creation that was stopped)."""
    with suppress(EmptyCaptureError):
        open_reader(path).dispose()


def _sqlite_writer_engine(path: Path) -> Engine:
    uri = file_uri(path, mode="rwc")
    engine = create_engine(
        URL.create("sqlite", database=str(path)),
        poolclass=QueuePool,
        creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False),
    )
    _on_connect(
        engine,
        f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}",
        "PRAGMA journal_mode = WAL",
        "PRAGMA synchronous = NORMAL",
        "PRAGMA cache_size = -65536",  # 64 MiB page cache for bulk inserts
        autocommit=True,
    )

    @event.listens_for(engine, "begin")
    def _begin_immediate(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _ensure_schema(engine: Engine, name: str) -> None:
    """Create the schema, or check and upgrade the one there, in one transaction: a writer
    killed meanwhile leaves no half schema, and a second writer starting on the same new file
    waits for the first (SQLite) or finds its tables and tries again (a server database)."""
    for attempt in range(SCHEMA_ATTEMPTS):
        try:
            with engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK_KEY})
                _create_or_upgrade(conn, name)
            return
        except CaptureError:
            raise
        except (SQLAlchemyError, sqlite3.Error) as err:
            if attempt + 1 < SCHEMA_ATTEMPTS and "already exists" in str(err):
                continue
            raise CaptureError(f"{name}: cannot write the capture ({first_line(err)})") from err


def _create_or_upgrade(conn: Connection, name: str) -> None:
    tables = set(inspect(conn).get_table_names())
    if not tables:
        schema.metadata.create_all(conn)
        conn.execute(schema.meta.insert(), [{"key": "schema_version", "value": str(schema.SCHEMA_VERSION)}])
        return
    version = check_schema(conn, name)
    if version < schema.SCHEMA_VERSION:
        _upgrade(conn, version, tables)
    schema.metadata.create_all(conn, tables=[t for t in schema.OPTIONAL_TABLES if t.name not in tables])


def _upgrade(conn: Connection, version: int, tables: set[str]) -> None:
    """Bring a file of an older readable version up to SCHEMA_VERSION: add the later columns
    (NULL in every existing row) and indexes to the tables it has (a table it lacks is created whole
    after), then store the new version (in the caller's transaction)."""
    preparer = conn.dialect.identifier_preparer
    for column in schema.added_after(version):
        if column.table.name not in tables:
            continue
        ddl = CreateColumn(column).compile(dialect=conn.dialect)
        conn.execute(text(f"ALTER TABLE {preparer.format_table(column.table)} ADD COLUMN {ddl}"))
    for since, indexes in schema.INDEXES_SINCE.items():
        for index in indexes if since > version else ():
            if index.table is not None and index.table.name in tables:
                # NOTE: IF NOT EXISTS, not checkfirst: SQLAlchemy's index lookup on PostgreSQL passes a bind
                # parameter that the BIGINT rule (schema.py) casts to a type generate_subscripts refuses
                conn.execute(CreateIndex(index, if_not_exists=True))
    conn.execute(
        update(schema.meta).where(schema.meta.c.key == "schema_version").values(value=str(schema.SCHEMA_VERSION))
    )


def settle(engine: Engine) -> bool:
    """After the last write: fold a SQLite file's log into it and leave one file (see
    sqlite_files.settle_file). Disposes the engine's connections first. False when the fold
    could not be done (a reader mid-read for the whole wait, a full disk): the log then stays,
    and every committed row with it."""
    if engine.dialect.name != "sqlite" or not engine.url.database:
        return False
    engine.dispose()
    return settle_file(Path(engine.url.database))


def save_report(target: str | Path, run_id: int, kind: str, through_seq: int, producer: str, body: str) -> None:
    """Store (or replace) a derived report of a run in the capture."""
    engine = open_writer(target)
    try:
        table = schema.reports
        with engine.begin() as conn:
            conn.execute(table.delete().where(table.c.run_id == run_id, table.c.kind == kind))
            conn.execute(
                table.insert(),
                [
                    {
                        "run_id": run_id,
                        "kind": kind,
                        "through_seq": through_seq,
                        "built_at": time.time(),
                        "producer": producer,
                        "body": body,
                    }
                ],
            )
    except SQLAlchemyError as err:
        raise CaptureError(f"{display_name(target)}: cannot store the {kind} report ({first_line(err)})") from err
    finally:
        settle(engine)
        engine.dispose()


def save_ledger_checkpoint(
    engine: Engine, run_id: int, through_seq: int, step: int, producer: str, body: bytes
) -> None:
    """Store (or replace) a run's ledger checkpoint (schema.ledger_checkpoints), in one transaction:
    a reader sees the old state or the new one."""
    table = schema.ledger_checkpoints
    with engine.begin() as conn:
        conn.execute(table.delete().where(table.c.run_id == run_id))
        conn.execute(
            table.insert(),
            [
                {
                    "run_id": run_id,
                    "through_seq": through_seq,
                    "step": step,
                    "producer": producer,
                    "built_at": time.time(),
                    "body": body,
                }
            ],
        )


def insert_statement(engine: Engine, table: Table, columns: Sequence[str]) -> Statement:
    """An executemany-ready INSERT of positional rows (`columns` order) in the dialect's paramstyle."""
    return compiled_statement(engine, table.insert().values({c: None for c in columns}), columns)


def upsert_statement(
    engine: Engine, table: Table, columns: Sequence[str], key: Sequence[str], replace_when: Any = None
) -> Statement:
    """insert_statement's INSERT that keeps the row already stored at `key` (a second row at the same
    key is skipped, never a write error); `replace_when(stored, new)`, a condition on the stored row's
    columns and the new row's (ON CONFLICT's `excluded`), replaces the stored row where it holds.
    SQLite and PostgreSQL; another database gets the plain INSERT."""
    name = engine.dialect.name
    if name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert  # type: ignore[assignment]
    else:
        return insert_statement(engine, table, columns)
    stmt = insert(table).values({c: None for c in columns})
    if replace_when is None:
        stmt = stmt.on_conflict_do_nothing(index_elements=list(key))
    else:
        rest = [c for c in columns if c not in key]
        stmt = stmt.on_conflict_do_update(
            index_elements=list(key),
            set_={c: stmt.excluded[c] for c in rest},
            where=replace_when(table.c, stmt.excluded),
        )
    return compiled_statement(engine, stmt, columns)


def add_statement(engine: Engine, table: Table, columns: Sequence[str], key: Sequence[str], merged: Any) -> Statement:
    """insert_statement's INSERT that, where a row is stored at `key` already, sets each column of
    `merged(stored, new)` (a dict of expressions over the stored row's columns and the new row's) instead:
    sums that every batch adds to. SQLite and PostgreSQL only (CaptureError on another database)."""
    name = engine.dialect.name
    if name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert  # type: ignore[assignment]
    else:
        raise CaptureError(f"{engine.url.get_backend_name()}: kvscope writes captures to SQLite or PostgreSQL only")
    stmt = insert(table).values({c: None for c in columns})
    stmt = stmt.on_conflict_do_update(index_elements=list(key), set_=merged(table.c, stmt.excluded))
    return compiled_statement(engine, stmt, columns)


def compiled_statement(engine: Engine, stmt: Any, columns: Sequence[str]) -> Statement:
    """`stmt` (its bind parameters named as `columns`) compiled for the engine's dialect, run
    through the driver with rows of values in `columns` order."""
    compiled = stmt.compile(dialect=engine.dialect)
    names = tuple(str(c) for c in columns)  # NOTE: plain str (SQLAlchemy's names are a str subclass)
    if not compiled.positional:
        return Statement(str(compiled), names, None)
    return Statement(str(compiled), names, tuple(names.index(str(name)) for name in compiled.positiontup or []))
