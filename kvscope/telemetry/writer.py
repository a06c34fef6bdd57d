"""The recorder's writer process: it takes the recorder's batches off the channel, packs their
events into chunks (packed.py) and writes them with the other tables' rows into the capture,
one transaction for whatever batches are waiting, and acknowledges them. The recording
process never packs, converts or writes, and never shares its interpreter lock with this work.

    python -m kvscope.telemetry.writer FD      (started by SQLRecorder; FD: its end of the channel)

NOTE: messages (channel.py frames; headers are tuples, the first value names the message)
    recorder -> writer
        ("start", settings)       first, once: WriterSettings.to_plain()
        ("batch", number, first_item, first_row, step, closing, has_batches)
                                  body: marshal of (items, rows): the flat buffered items
                                  (packed.ITEM_FIELDS) and (table, row) pairs; first_item and
                                  first_row count what came before, so a batch sent again
                                  (the sender interrupted between sending and forgetting it)
                                  is written once
        ("close",)                everything is sent: answer "closed" and exit
    writer -> recorder
        ("ack", number, items_done, complete_step)
                                  batches up to `number` are on disk (or dropped, once
                                  recording stopped); every row of steps <= complete_step is
        ("failed", reason)        a write failed: recording stopped, nothing more is written
        ("ready",)                the start message arrived (the writer's imports are done)
        ("closed", complete_step) the last answer
It ends on "close", or when the recorder's end of the channel closes (the recording process
died): what it received is written first. It ignores SIGINT, SIGTERM and SIGHUP (the recorder
decides when it ends, and a terminal's Ctrl-C reaches the recorder's process group, not this
one) and SIGXFSZ (a file-size limit fails the write, as a full disk does, instead of killing it).
It imports no SQLAlchemy for a capture file: sqlite3 directly, the same pragmas as the store.
NOTE: the heartbeat (runs.heartbeat_at) is written with every batch and, while no batch comes,
every `heartbeat_interval_s`: it beats exactly while the recording process lives (the channel
is open), so an idle run reads as running and a killed one stops beating. A beat that cannot
be written is skipped (the next batch reports a real write failure); none once recording stopped.
"""

from __future__ import annotations

import json
import marshal
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple

from kvscope.telemetry.channel import Channel, ChannelClosed, Message
from kvscope.telemetry.packed import ITEM_WIDTH, Packer, SummaryFold
from kvscope.telemetry.request_sums import sums_rows
from kvscope.telemetry.retention import ChunkMark, Retention, RetentionPass
from kvscope.telemetry.sqlite_files import BUSY_TIMEOUT_MS, execute_when_free, file_uri, first_line

HEARTBEAT_INTERVAL_S = 5.0  # NOTE: readers call a run dead after queries.STALE_HEARTBEAT_S (30 s) without one
CHUNK_ITEMS = 65_536  # NOTE: a larger batch is packed as several chunks (their columns stay in the CPU's caches)
# NOTE: the fold (schema 14) is stored once the chunks packed since it was last stored number its rows / this, and
# with the closing batch: a fold of a few hundred keys goes with every transaction, one of 10,000 principals
# (5.7 ms to write out) every 20 chunks, and its readers read those few chunks after it
FOLD_ROWS_PER_CHUNK = 512


class Statement(NamedTuple):
    """A statement in the database's own parameter style: `columns` name a row's values in
    order; `order` is the order the statement takes them in (positional), or None (named)."""

    sql: str
    columns: tuple[str, ...]
    order: tuple[int, ...] | None

    def params(self, rows: Sequence[Sequence[Any]]) -> list[Any]:
        order = self.order
        if order is None:
            return [dict(zip(self.columns, row, strict=True)) for row in rows]
        if order == tuple(range(len(self.columns))):
            return list(rows)
        return [tuple(row[i] for i in order) for row in rows]


class RetentionStatements(NamedTuple):
    """The retention pass's statements (retention.py): the run's event_retention row (insert: its
    columns; update: first_seq, first_step, dropped_chunks, dropped_bytes, dropped_at, run_id), the
    deletes of its chunks up to a number (run_id, chunk), the read of its ledger checkpoint's
    through_seq (run_id), the delete of its tree snapshots before a step but at a leak check's
    (run_id, first_step), the thinning of its usage rows between two steps (run_id, from_step,
    first_step), and the delete of one of its strings (run_id, code)."""

    insert: Statement
    update: Statement
    delete_columns: Statement
    delete_chunks: Statement
    checkpoint: Statement
    delete_snapshots: Statement
    thin_usage: Statement
    delete_strings: Statement


class WriterSettings(NamedTuple):
    """What the writer writes where: `file` (a SQLite file) or `url` (any other database,
    through SQLAlchemy); the run; one insert per table and the heartbeat update (columns
    heartbeat_at, run_id), written at least every `heartbeat_interval_s`; what the run keeps
    of its events (`retention`, with its statements; None: everything)."""

    file: str | None
    url: str | None
    run_id: int
    inserts: dict[str, Statement]
    heartbeat: Statement
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    retention: Retention | None = None
    retention_statements: RetentionStatements | None = None

    def to_plain(self) -> tuple[Any, ...]:
        statements = self.retention_statements
        return (
            self.file,
            self.url,
            self.run_id,
            {name: tuple(s) for name, s in self.inserts.items()},
            tuple(self.heartbeat),
            self.heartbeat_interval_s,
            None if self.retention is None else tuple(self.retention),
            None if statements is None else tuple(tuple(s) for s in statements),
        )

    @classmethod
    def from_plain(cls, plain: tuple[Any, ...]) -> WriterSettings:
        file, url, run_id, inserts, heartbeat, interval_s, retention, statements = plain
        return cls(
            file,
            url,
            run_id,
            {name: Statement(*s) for name, s in inserts.items()},
            Statement(*heartbeat),
            interval_s,
            None if retention is None else Retention(*retention),
            None if statements is None else RetentionStatements(*(Statement(*s) for s in statements)),
        )


# NOTE: the -wal log left on disk after it restarts. A reader holding one snapshot (a long dashboard
# read) keeps the log from restarting, so it grows by what is written meanwhile; without a limit SQLite
# keeps that high-water size on disk for the file's life.
WAL_LIMIT_BYTES = 64 << 20


class SQLiteSink:
    """Transactions on a capture file through sqlite3."""

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(file_uri(Path(path), mode="rw"), uri=True, isolation_level=None)
        cursor = self.conn.cursor()
        # NOTE: no journal mode: the store put the file in WAL mode, and a file another run's close
        # put back in rollback mode meanwhile is written as it is
        for pragma in (
            f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}",
            "PRAGMA synchronous = NORMAL",
            "PRAGMA cache_size = -65536",
            f"PRAGMA journal_size_limit = {WAL_LIMIT_BYTES}",
        ):
            execute_when_free(cursor, pragma)
        cursor.close()

    def write(self, work: list[tuple[Statement, list[Any]]]) -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement, rows in work:
                conn.executemany(statement.sql, statement.params(rows))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def used_bytes(self) -> int | None:
        """The database's pages in use, in bytes (free pages are reused before the file grows)."""
        conn = self.conn
        pages = conn.execute("PRAGMA page_count").fetchone()[0] - conn.execute("PRAGMA freelist_count").fetchone()[0]
        return int(pages) * int(conn.execute("PRAGMA page_size").fetchone()[0])

    def scalar(self, statement: Statement, row: tuple[Any, ...]) -> Any:
        found = self.conn.execute(statement.sql, statement.params([row])[0]).fetchone()
        return None if found is None else found[0]

    def close(self) -> None:
        self.conn.close()


class DatabaseSink:
    """Transactions on a server database through SQLAlchemy (imported only here)."""

    def __init__(self, url: str) -> None:
        import logging

        from sqlalchemy import create_engine

        # NOTE: a driver's own warnings (psycopg's about a pipeline on a lost connection) would be a second
        # line beside the recorder's one about the failed write
        logging.getLogger("psycopg").addHandler(logging.NullHandler())
        self.engine = create_engine(url)

    def write(self, work: list[tuple[Statement, list[Any]]]) -> None:
        with self.engine.begin() as conn:
            for statement, rows in work:
                conn.exec_driver_sql(statement.sql, statement.params(rows))

    def used_bytes(self) -> int | None:
        return None  # NOTE: a shared server database: the pass counts the run's own event bytes

    def scalar(self, statement: Statement, row: tuple[Any, ...]) -> Any:
        with self.engine.connect() as conn:
            found = conn.exec_driver_sql(statement.sql, statement.params([row])[0]).first()
        return None if found is None else found[0]

    def close(self) -> None:
        self.engine.dispose()


class Writer:
    """Batches in, transactions out; the run's packer and what is complete so far."""

    def __init__(self, settings: WriterSettings) -> None:
        self.settings = settings
        self.failure: str | None = None  # NOTE: set once a write failed: recording stopped
        self.sink: SQLiteSink | DatabaseSink | None = None  # NOTE: opened by the first write
        self.packer = Packer()
        # NOTE: the run's chunk summaries folded (schema 14), stored with the chunks it folds; None once a
        # retention drop ended it (the empty fold stored then says so: readers read every chunk)
        self.fold: SummaryFold | None = SummaryFold()
        self._unstored = 0  # NOTE: chunks folded since the fold was last stored
        self.next_item = 0
        self.next_row = 0
        self.complete_step = -1  # NOTE: every row of steps <= this is committed
        retention, statements = settings.retention, settings.retention_statements
        self.retention = (
            RetentionPass(settings.run_id, retention, statements, self.packer.codes)
            if retention is not None and retention.bounded and statements is not None
            else None
        )
        self._marks: list[ChunkMark] = []  # NOTE: the chunks of the transaction being written
        self.retention_failed = False

    def write(self, batches: list[Message]) -> None:
        """Write the batches in one transaction (or drop them once recording stopped). Under a size
        bound, one transaction per batch with a retention pass after each: batches that piled up
        while the writer was slow would otherwise land at once, past the pass's margin."""
        if len(batches) > 1 and self.retention is not None and self.retention.retention.max_bytes is not None:
            for message in batches:
                self.write([message])
            return
        items: list[Any] = []
        rows: list[tuple[str, tuple[Any, ...]]] = []
        has_batches = closing_run = False
        done_step = self.complete_step
        for message in batches:
            _, _number, first_item, first_row, step, closing, batched = message.header
            body_items, body_rows = marshal.loads(message.body) if message.body is not None else ([], [])
            message.release()
            skip_items, skip_rows = max(0, self.next_item - first_item), max(0, self.next_row - first_row)
            self.next_item = max(self.next_item, first_item + len(body_items) // ITEM_WIDTH)
            self.next_row = max(self.next_row, first_row + len(body_rows))
            if skip_items:  # NOTE: sent again: what this writer has already taken is skipped
                del body_items[: skip_items * ITEM_WIDTH]
            if skip_rows:
                del body_rows[:skip_rows]
            if items:
                items += body_items
            else:
                items = body_items  # NOTE: no copy of the usual single batch
            rows += body_rows
            has_batches = has_batches or bool(batched)
            closing_run = closing_run or bool(closing)
            done_step = step if closing else step - 1
        if self.failure is not None:
            return
        try:
            self._sink().write(self._work(items, rows, has_batches, closing_run))
        except Exception as err:
            self.failure = first_line(err)
            return
        self.complete_step = max(self.complete_step, done_step)
        self._retain()

    def _retain(self) -> None:
        """The retention pass, between transactions (retention.py); one that fails (a busy or full
        database) drops nothing and is tried again after the next batch; the first failure is one
        line on stderr (the capture may then outgrow its bound), and so is a bound that what the
        run keeps for life passes."""
        if self.retention is None:
            return
        self.retention.wrote(self._marks)
        self._marks = []
        try:
            line = self.retention.after_write(self._sink())
        except Exception as err:
            if not self.retention_failed:
                self.retention_failed = True
                print(f"kvscope recorder: retention could not drop events: {first_line(err)}", file=sys.stderr)
            return
        if line is not None:
            print(line, file=sys.stderr, flush=True)

    def beat(self) -> None:
        """The heartbeat alone (no batch came for a while); skipped once recording stopped, and
        when it cannot be written (a busy or full database: the next batch says so)."""
        if self.failure is not None:
            return
        with suppress(Exception):
            self._sink().write([(self.settings.heartbeat, [(time.time(), self.settings.run_id)])])

    def _sink(self) -> SQLiteSink | DatabaseSink:
        if self.sink is None:
            file, url = self.settings.file, self.settings.url
            self.sink = SQLiteSink(file) if file is not None else DatabaseSink(str(url))
        return self.sink

    def _work(
        self, items: list[Any], rows: list[tuple[str, tuple[Any, ...]]], has_batches: bool, closing: bool = False
    ) -> list[tuple[Statement, list[Any]]]:
        inserts, run_id = self.settings.inserts, self.settings.run_id
        tables: dict[str, list[Any]] = {name: [] for name in inserts}
        step = CHUNK_ITEMS * ITEM_WIDTH
        self._marks = []
        for start in range(0, len(items), step):
            chunk = self.packer.pack(
                items[start : start + step] if len(items) > step else items, has_batches=has_batches
            )
            number = self.packer.num_chunks - 1  # NOTE: pack order, as the packer's string codes count chunks
            for table, values in chunk.table_rows(run_id, number).items():
                tables[table] += values
            self._marks.append(
                ChunkMark(
                    number, chunk.first_seq, chunk.num_events, chunk.first_step, chunk.last_t_mono, chunk.num_bytes
                )
            )
            if self.fold is not None:
                self.fold.add(number, chunk.num_events, json.loads(chunk.kind_counts), json.loads(chunk.groups))
        for table, row in rows:
            tables[table].append(row)
        if tables.get("requests") and "request_sums" in inserts:  # NOTE: summed in the same transaction
            columns = inserts["requests"].columns
            tables["request_sums"], tables["request_latencies"] = sums_rows(run_id, columns, tables["requests"])
        if "run_summaries" in inserts:
            tables["run_summaries"] = self._fold_rows(len(self._marks), closing)
        work = [(inserts[name], values) for name, values in tables.items() if values]
        first = self.retention.first_rows() if self.retention is not None else []
        return [*first, *work, (self.settings.heartbeat, [(time.time(), run_id)])]

    def _fold_rows(self, packed: int, closing: bool) -> list[tuple[Any, ...]]:
        """The run's run_summaries row, when this transaction's chunks and those packed since it was last
        stored are enough (FOLD_ROWS_PER_CHUNK) or the run closes; after the retention pass's first drop, the
        empty fold once (through_chunk -1: the run's readers read every chunk kept) and then none."""
        if self.fold is None:
            return []
        if self.retention is not None and self.retention.dropped_chunks:
            self.fold = None
            return [SummaryFold().row(self.settings.run_id)]
        self._unstored += packed
        if not self._unstored or (not closing and self._unstored * FOLD_ROWS_PER_CHUNK < self.fold.num_rows):
            return []
        self._unstored = 0
        return [self.fold.row(self.settings.run_id)]

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
            self.sink = None


def serve(channel: Channel) -> None:
    """The writer's loop, until the recorder closes it or goes away."""
    first = channel.receive()
    assert first is not None and first.kind == "start", "the recorder speaks first"
    writer = Writer(WriterSettings.from_plain(first.header[1]))
    _answer(channel, ("ready",))
    interval_s = writer.settings.heartbeat_interval_s
    beat_due_s = time.monotonic() + interval_s
    try:
        while True:
            try:
                arrived = channel.receive(max(0.0, beat_due_s - time.monotonic()))
                messages = [arrived, *channel.poll()] if arrived is not None else []
            except ChannelClosed:
                return  # NOTE: the recording process is gone; every batch it sent is written
            batches = [m for m in messages if m.kind == "batch"]
            if batches or time.monotonic() >= beat_due_s:
                beat_due_s = time.monotonic() + interval_s
            if not messages:
                writer.beat()
            if batches:
                failed_before = writer.failure is not None
                writer.write(batches)
                if writer.failure is not None and not failed_before:
                    _answer(channel, ("failed", writer.failure))
                _answer(channel, ("ack", batches[-1].header[1], writer.next_item, writer.complete_step))
            if any(m.kind == "close" for m in messages):
                writer.close()  # NOTE: before the answer: the recorder folds the log once it has it
                _answer(channel, ("closed", writer.complete_step))
                return
    finally:
        writer.close()


def _answer(channel: Channel, header: tuple[Any, ...]) -> None:
    with suppress(ChannelClosed):  # NOTE: the recorder is gone; the batches still get written
        channel.send(header)


def main(argv: list[str]) -> int:
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    channel = Channel.from_fd(int(argv[0]))
    try:
        serve(channel)
    except Exception as err:  # NOTE: one line, never a traceback; the recorder reports the end
        print(
            f"kvscope recorder: the writer process stopped: {type(err).__name__}: {first_line(err)}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(code)  # NOTE: everything is written and closed; the interpreter's teardown would cost ~20 ms
