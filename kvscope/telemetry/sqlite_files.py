"""SQLite file names, headers and error lines without SQLAlchemy: what the recorder's writer
process needs to open a capture file (it imports no SQLAlchemy for a file target;
kvscope.telemetry.store re-exports these for everything else).

NOTE: reading a header without dropping locks. SQLite locks a file with POSIX record locks,
which belong to the process and are ALL released when the process closes ANY descriptor of the
file. A reader that opened a capture's header with open() and closed it would silently drop
every lock this process's SQLite connections hold on it; another process (the recorder's writer
closing its connection, a run's close folding the log) would then take this process's
connections for gone and delete the log under them. read_head keeps the descriptor it read
through open, one per file, and closes it only when nothing else in this process has the file
open (SQLite's own unix layer parks descriptors for the same reason).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

BUSY_TIMEOUT_MS = 10_000
BUSY_RETRY_S = 0.01
SETTLE_WAIT_MS = 3_000  # how long a closing writer waits for readers mid-read before it folds the log
_BUSY_CODES = {5, 6}  # SQLITE_BUSY, SQLITE_LOCKED


def file_uri(path: Path, **params: str) -> str:
    """A SQLite `file:` URI naming `path` verbatim: every character but letters, digits and
    `/_.-~` percent-encoded, so `?`, `#` and `%` in a name stay part of it."""
    query = "&".join(f"{key}={value}" for key, value in params.items())
    return f"file://{quote(os.path.abspath(path), safe='/')}?{query}"


def first_line(err: BaseException) -> str:
    """An error's first line (a SQLAlchemy error's driver message, without the SQL)."""
    text = str(getattr(err, "orig", None) or err)
    return text.splitlines()[0] if text else type(err).__name__


def execute_when_free(cursor: sqlite3.Cursor, statement: str) -> None:
    """Run a connection pragma, trying again while another connection holds the lock it needs,
    for up to the busy timeout. SQLite's busy handler does not cover every case: two
    connections switching one new file to WAL at once both hold a shared lock and want an
    exclusive one, and SQLite fails one of them at once with "database is locked" rather
    than let them wait on each other."""
    deadline_s = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute(statement)
            return
        except sqlite3.OperationalError as err:
            busy = (getattr(err, "sqlite_errorcode", 0) & 0xFF) in _BUSY_CODES
            if not busy or time.monotonic() >= deadline_s:
                raise
            time.sleep(BUSY_RETRY_S)


_PARKED: dict[tuple[int, int], int] = {}  # NOTE: (st_dev, st_ino) -> a descriptor read_head keeps open


def read_head(path: Path, num_bytes: int) -> bytes:
    """The first `num_bytes` of a file, read without closing a descriptor of a file this
    process may hold SQLite locks on (see the module's note). OSError as open() raises it."""
    info = os.stat(path)
    fd = _PARKED.get((info.st_dev, info.st_ino))
    if fd is None:  # NOTE: never a second descriptor of a parked file: closing it would drop the locks
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        opened = os.fstat(fd)
        _PARKED[(opened.st_dev, opened.st_ino)] = fd
    head = os.pread(fd, num_bytes, 0)
    _close_unshared()
    return head


def _close_unshared() -> None:
    """Close the parked descriptors of files nothing else in this process has open."""
    try:
        names = os.listdir("/dev/fd")
    except OSError:
        return  # NOTE: no way to tell: keep them (one per file)
    parked_fds = set(_PARKED.values())
    open_files: dict[tuple[int, int], int] = {}
    for name in names:
        if not name.isdigit() or int(name) in parked_fds:
            continue
        with contextlib.suppress(OSError):
            info = os.fstat(int(name))
            key = (info.st_dev, info.st_ino)
            open_files[key] = open_files.get(key, 0) + 1
    for key, fd in list(_PARKED.items()):
        if key not in open_files:
            del _PARKED[key]
            os.close(fd)


def settle_file(path: Path) -> bool:
    """After a writer's last write: make the capture one file a copy of which reads whole.

    With no other connection on the file, it goes back to rollback mode: the log is folded in
    and the -wal and -shm are deleted. While another process holds it open (a dashboard reading
    it, another run writing), SQLite keeps WAL mode; the log is then folded in and truncated
    to 0 bytes (checkpoint TRUNCATE, waiting up to SETTLE_WAIT_MS for readers mid-read): the
    file alone holds every committed row, and an empty -wal and the -shm stay until a writer
    is the last to close it. False when neither could be done (a reader mid-read for the
    whole wait, a full disk): the log then stays, and every committed row with it."""
    try:
        conn = sqlite3.connect(file_uri(path, mode="rw"), uri=True, timeout=0, isolation_level=None)
    except sqlite3.Error:
        return False
    try:
        with contextlib.suppress(sqlite3.OperationalError):  # NOTE: "database is locked": not the only one
            if str(conn.execute("PRAGMA journal_mode = DELETE").fetchone()[0]).lower() == "delete":
                return True
        conn.execute(f"PRAGMA busy_timeout = {SETTLE_WAIT_MS}")
        busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return bool(busy == 0)
    except sqlite3.Error:
        return False
    finally:
        conn.close()
