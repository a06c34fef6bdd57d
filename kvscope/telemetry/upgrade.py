"""`kvscope upgrade`: pack the event rows of runs written before schema version 6 into chunks
(packed.py), so they read as fast as new runs. Readers read the row layout too; upgrading is
for speed and size, never needed to open a file.

NOTE: what it keeps. Every event keeps its seq, step, time and fields; a chunk never spans a
gap in the seqs (a run stopped by a failed write has none, but a hand-edited file may). A run
is packed in one transaction: its chunks are written and its rows deleted together, so a kill
leaves each run either as rows or as chunks. A run still being written (status running, with a
live writer) is refused, and so is a file this kvscope cannot read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, delete, func, select

from kvscope.telemetry import schema
from kvscope.telemetry.packed import ITEM_WIDTH, Packer
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.store import CaptureError, display_name, first_line, insert_statement, open_writer, settle
from kvscope.telemetry.writer import Statement

CHUNK_EVENTS = 200_000
ROW_FIELDS = schema.EVENT_COLUMNS[1:]  # NOTE: seq, then packed.ITEM_FIELDS in the same order


@dataclass
class UpgradedRun:
    run_id: int
    events: int
    chunks: int


def upgrade(target: str | Path, *, progress: Callable[[int, int, int], None] | None = None) -> list[UpgradedRun]:
    """Pack every row-layout run of the capture; returns what was packed. `progress(run_id,
    events done, events in the run)` is called after each chunk."""
    name = display_name(target)
    if not _check_upgradable(target, name):
        return []  # NOTE: nothing to do: the file is not opened for writing, so not rewritten
    engine = open_writer(target)  # NOTE: brings the file to the current version (the packed tables)
    try:
        with engine.connect() as conn:
            e = schema.events.c
            counts = conn.execute(select(e.run_id, func.count()).group_by(e.run_id).order_by(e.run_id)).fetchall()
        done = []
        for run_id, total in counts:
            done.append(_pack_run(engine, int(run_id), int(total), progress))
        settle(engine)
        return done
    except CaptureError:
        raise
    except Exception as err:
        raise CaptureError(f"{name}: cannot upgrade ({first_line(err)})") from err
    finally:
        engine.dispose()


def _check_upgradable(target: str | Path, name: str) -> bool:
    """A capture this kvscope reads (missing, foreign, damaged or newer files are refused, and
    no file is created), with no run still being recorded; True when it has something to upgrade
    (an older schema, or events in the row layout)."""
    capture = Capture(target)
    try:
        runs = capture.runs()
        older = capture.schema_version < schema.SCHEMA_VERSION
        with capture.engine.connect() as conn:
            rows = conn.execute(select(schema.events.c.run_id).limit(1)).first() is not None
    finally:
        capture.close()
    live = [int(r.id) for r in runs.itertuples() if r.display_status == "running"]
    if live:
        raise CaptureError(f"{name}: run {live[0]} is still being recorded; upgrade it once it has ended")
    return older or rows


def _pack_run(engine: Engine, run_id: int, total: int, progress: Callable[[int, int, int], None] | None) -> UpgradedRun:
    e = schema.events.c
    inserts = {t.name: insert_statement(engine, t, [c.name for c in t.columns]) for t in schema.PACKED_TABLES}
    packer = Packer()
    chunk_no = 0
    done = 0
    with engine.begin() as conn:
        existing = conn.execute(
            select(func.count()).select_from(schema.event_chunks).where(schema.event_chunks.c.run_id == run_id)
        ).scalar_one()
        if existing:
            raise CaptureError(f"run {run_id} has both event rows and packed chunks; not touching it")
        cursor = conn.execute(select(*(e[n] for n in ROW_FIELDS)).where(e.run_id == run_id).order_by(e.seq))
        pending: list[Any] = []
        first_seq = None
        while rows := cursor.fetchmany(CHUNK_EVENTS):
            for row in rows:
                seq = int(row[0])
                if first_seq is None:
                    first_seq = seq
                elif seq != first_seq + len(pending) // ITEM_WIDTH or len(pending) >= CHUNK_EVENTS * ITEM_WIDTH:
                    chunk_no = _write_chunk(conn, inserts, packer, run_id, chunk_no, first_seq, pending)
                    pending, first_seq = [], seq
                pending.extend(row[1:12])  # NOTE: ITEM_FIELDS, slots as the row layout's int32 blob
            done += len(rows)
            if progress is not None:
                progress(run_id, done, total)
        if pending:
            assert first_seq is not None
            chunk_no = _write_chunk(conn, inserts, packer, run_id, chunk_no, first_seq, pending)
        conn.execute(delete(schema.events).where(e.run_id == run_id))
    return UpgradedRun(run_id, total, chunk_no)


def _write_chunk(
    conn: Connection,
    inserts: dict[str, Statement],
    packer: Packer,
    run_id: int,
    number: int,
    first_seq: int,
    buffered: list[Any],
) -> int:
    packer.next_seq = first_seq
    chunk = packer.pack(buffered, slot_dtype="<i4")
    for table, values in chunk.table_rows(run_id, number).items():
        if values:
            insert = inserts[table]
            conn.exec_driver_sql(insert.sql, insert.params(values))
    return number + 1
