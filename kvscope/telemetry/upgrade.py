"""`kvscope upgrade`: pack the event rows of runs written before schema version 6 into chunks
(packed.py), and store the summaries of chunks written before version 10 (packed.summaries: their events
per kind and grouped sums) and their carries of version 11 (carry.py: evictions per step, net lock
changes, requests left running), the request sums of version 12 (request_sums.py: totals and latency
histograms per principal) of runs written before it, and the fold of a run's chunk summaries of version 14
(run_summaries: packed.SummaryFold), so they read as fast as new runs. Readers read the row layout and
unsummarized chunks too; upgrading is for speed and size, never needed to open a file.

NOTE: what it keeps. Every event keeps its seq, step, time and fields; a chunk never spans a
gap in the seqs (a run stopped by a failed write has none, but a hand-edited file may). A run
is packed in one transaction: its chunks are written and its rows deleted together, so a kill
leaves each run either as rows or as chunks. A run still being written (status running, with a
live writer) is refused, and so is a file this kvscope cannot read. A run's summaries are stored in
transactions of SUMMARY_CHUNKS chunks: a kill leaves some chunks summarized and the rest as they were
(a reader computes those, and the next upgrade goes on). A run's request sums are stored in one
transaction with its mark (runs.request_sums): a kill leaves the run read from its request rows. A run's
fold is stored in one transaction, after its chunks' summaries: a kill leaves the run read chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from sqlalchemy import Connection, Engine, bindparam, delete, func, or_, select, update

from kvscope.telemetry import schema
from kvscope.telemetry.carry import CARRY_FIELDS
from kvscope.telemetry.packed import ITEM_WIDTH, SUMMARY_FIELDS, Packer, SummaryFold
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import request_sum_statements, run_summary_statement
from kvscope.telemetry.request_sums import REQUEST_LATENCIES, sums_rows
from kvscope.telemetry.store import (
    CaptureError,
    compiled_statement,
    display_name,
    first_line,
    insert_statement,
    open_writer,
    settle,
    stored_version,
)
from kvscope.telemetry.writer import Statement

CHUNK_EVENTS = 200_000
SUM_REQUESTS = 200_000  # request rows read and summed at a time
SUMMARY_CHUNKS = 64  # chunks summarized per transaction (a 100 M-event run has about 5,000)
FOLD_CHUNKS = 256  # chunks folded between two progress calls
REQUEST_TIMES = tuple(sorted({moment for span in REQUEST_LATENCIES.values() for moment in span}))
ROW_FIELDS = schema.EVENT_COLUMNS[1:]  # NOTE: seq, then packed.ITEM_FIELDS in the same order


@dataclass
class UpgradedRun:
    run_id: int
    events: int  # packed from rows (0: the run was packed already)
    chunks: int
    summarized: int = 0  # chunks whose summaries were stored
    requests_summed: int | None = None  # requests whose sums were stored (None: the run had them)
    folded: int = 0  # chunks whose summaries were folded into the run's run_summaries row


def upgrade(
    target: str | Path,
    *,
    progress: Callable[[int, int, int], None] | None = None,
    summarizing: Callable[[int, int, int], None] | None = None,
    summing: Callable[[int, int, int], None] | None = None,
    folding: Callable[[int, int, int], None] | None = None,
) -> list[UpgradedRun]:
    """Pack every row-layout run of the capture, summarize every chunk without summaries and sum the
    requests of every run without request sums, and fold the chunk summaries of every run without a fold
    that describes them; returns what was done, by run. `progress(run_id, events done, events in the run)`
    is called after each packed chunk, `summarizing(run_id, chunks done, chunks to do)` after each
    summarized one, `summing(run_id, requests done, requests in the run)` after each batch of requests
    summed, `folding(run_id, chunks done, chunks in the run)` after each FOLD_CHUNKS chunks folded."""
    name = display_name(target)
    if not _check_upgradable(target, name):
        return []  # NOTE: nothing to do: the file is not opened for writing, so not rewritten
    engine = open_writer(target)  # NOTE: brings the file to the current version (the packed tables)
    try:
        with engine.connect() as conn:
            e = schema.events.c
            counts = conn.execute(select(e.run_id, func.count()).group_by(e.run_id).order_by(e.run_id)).fetchall()
        done = {int(run_id): _pack_run(engine, int(run_id), int(total), progress) for run_id, total in counts}
        for run_id in _unsummarized_runs(engine):
            summarized = _summarize_run(target, engine, run_id, summarizing)
            done.setdefault(run_id, UpgradedRun(run_id, 0, 0)).summarized = summarized
        for run_id in _runs_without_request_sums(engine):
            summed = _sum_requests(engine, run_id, summing)
            done.setdefault(run_id, UpgradedRun(run_id, 0, 0)).requests_summed = summed
        for run_id, folded in _fold_runs(target, engine, folding):
            done.setdefault(run_id, UpgradedRun(run_id, 0, 0)).folded = folded
        settle(engine)
        return [done[run_id] for run_id in sorted(done)]
    except CaptureError:
        raise
    except Exception as err:
        raise CaptureError(f"{name}: cannot upgrade ({first_line(err)})") from err
    finally:
        engine.dispose()


def _check_upgradable(target: str | Path, name: str) -> bool:
    """A capture this kvscope reads (missing, foreign, damaged or newer files are refused, and
    no file is created), with no run still being recorded; True when it has something to upgrade
    (an older schema, events in the row layout, or chunks without summaries)."""
    capture = Capture(target)
    try:
        runs = capture.runs()
        older = capture.schema_version < schema.SCHEMA_VERSION
        with capture.engine.connect() as conn:
            rows = conn.execute(select(schema.events.c.run_id).limit(1)).first() is not None
        unsummarized = bool(_unsummarized_runs(capture.engine))
        unsummed = bool(_runs_without_request_sums(capture.engine))
        unfolded = bool(_unfolded_runs(capture))
    finally:
        capture.close()
    live = [int(r.id) for r in runs.itertuples() if r.display_status == "running"]
    if live:
        raise CaptureError(f"{name}: run {live[0]} is still being recorded; upgrade it once it has ended")
    return older or rows or unsummarized or unsummed or unfolded


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


def _unsummarized_runs(engine: Engine) -> list[int]:
    """The runs with a chunk that has no summaries (written before version 10)."""
    c = schema.event_chunks.c
    with engine.connect() as conn:
        tables = engine.dialect.get_table_names(conn)
        if schema.event_chunks.name not in tables or int(stored_version(conn) or 0) < schema.CHUNK_SUMMARY_SINCE:
            return [] if schema.event_chunks.name not in tables else _runs_with_chunks(conn)
        version = int(stored_version(conn) or 0)
        carries = (c.evict_steps.is_(None), c.lock_carry.is_(None), c.request_carry.is_(None))
        later = (
            *(carries if version >= schema.CARRY_SINCE else ()),
            *(c.miss_nodes.is_(None),) * (version >= schema.MISS_NODES_SINCE),
        )
        missing = or_(c.kind_counts.is_(None), *later)
        return [int(r) for (r,) in conn.execute(select(c.run_id).where(missing).distinct())]


def _runs_with_chunks(conn: Connection) -> list[int]:
    """Every run with chunks (a file older than version 10: none has summaries yet)."""
    c = schema.event_chunks.c
    return [int(r) for (r,) in conn.execute(select(c.run_id).distinct().order_by(c.run_id))]


def _unsummarized_chunks(capture: Capture, run_id: int) -> pd.DataFrame:
    """The run's chunks (chunk, first_seq, num_events, whole) missing a summary or a carry, in seq
    order; `whole`: missing more than miss_nodes (a chunk of version 11 lacks that one alone)."""
    c = schema.event_chunks.c
    older = or_(
        c.kind_counts.is_(None),
        c.groups.is_(None),
        c.evict_steps.is_(None),
        c.lock_carry.is_(None),
        c.request_carry.is_(None),
    )
    return capture.read_frame(
        select(c.chunk, c.first_seq, c.num_events, older.label("whole"))
        .where(c.run_id == run_id, or_(older, c.miss_nodes.is_(None)))
        .order_by(c.first_seq)
    )


def _summarize_run(
    target: str | Path, engine: Engine, run_id: int, summarizing: Callable[[int, int, int], None] | None
) -> int:
    """Store the summaries of the run's chunks that have none, SUMMARY_CHUNKS chunks a transaction;
    returns how many. The columns are read through a Capture (its checks and decoding)."""
    c = schema.event_chunks.c
    statement = compiled_statement(
        engine,
        update(schema.event_chunks)
        .where(c.run_id == bindparam("run"), c.chunk == bindparam("number"))
        .values(
            kind_counts=bindparam("counts"),
            groups=bindparam("names"),
            evict_steps=bindparam("evicts"),
            lock_carry=bindparam("locks"),
            request_carry=bindparam("requests"),
            miss_nodes=bindparam("misses"),
        ),
        ("counts", "names", "evicts", "locks", "requests", "misses", "run", "number"),
    )
    misses_only = compiled_statement(
        engine,
        update(schema.event_chunks)
        .where(c.run_id == bindparam("run"), c.chunk == bindparam("number"))
        .values(miss_nodes=bindparam("misses")),
        ("misses", "run", "number"),
    )
    capture = Capture(target)
    try:
        todo = _unsummarized_chunks(capture, run_id)
        for start in range(0, len(todo), SUMMARY_CHUNKS):
            part = todo.iloc[start : start + SUMMARY_CHUNKS]
            whole, misses = part[part.whole.astype(bool)], part[~part.whole.astype(bool)]
            capture.packed.prefetch(run_id, whole.chunk.tolist(), sorted({*SUMMARY_FIELDS, *CARRY_FIELDS}))
            rows = [
                (
                    *capture.packed.computed_summaries(run_id, chunk),
                    *capture.packed.computed_carries(run_id, chunk),
                    run_id,
                    int(chunk.chunk),
                )
                for chunk in whole.itertuples(index=False)
            ]
            computed = capture.packed.computed_carry(run_id, misses, "miss_nodes") if len(misses) else []
            with engine.begin() as conn:
                if rows:
                    conn.exec_driver_sql(statement.sql, statement.params(rows))
                if computed:
                    nodes = [(data, run_id, int(n)) for data, n in zip(computed, misses.chunk, strict=True)]
                    conn.exec_driver_sql(misses_only.sql, misses_only.params(nodes))
            if summarizing is not None:
                summarizing(run_id, start + len(part), len(todo))
        return len(todo)
    finally:
        capture.close()


def _runs_without_request_sums(engine: Engine) -> list[int]:
    """The runs whose request rows are not summed (written before version 12; every run of an older file)."""
    r = schema.runs.c
    with engine.connect() as conn:
        if int(stored_version(conn) or 0) < schema.REQUEST_SUMS_SINCE:
            return [int(i) for (i,) in conn.execute(select(r.id).order_by(r.id))]
        rows = conn.execute(select(r.id).where(or_(r.request_sums.is_(None), ~r.request_sums)).order_by(r.id))
        return [int(i) for (i,) in rows]


def _sum_requests(engine: Engine, run_id: int, summing: Callable[[int, int, int], None] | None) -> int:
    """Store the sums of the run's request rows (request_sums.py) and mark the run summed, in one
    transaction (a kill leaves the run unsummed, its readers on its rows); returns how many requests."""
    c = schema.requests.c
    columns = ("principal", "status", "prompt_len", "cached_tokens", "num_retractions", *REQUEST_TIMES)
    statements = request_sum_statements(engine)
    done = 0
    with engine.begin() as conn:
        total = int(conn.execute(select(func.count()).where(c.run_id == run_id)).scalar_one())
        for table in schema.REQUEST_SUM_TABLES:  # NOTE: sums a killed run's writer stored before it was marked
            conn.execute(delete(table).where(table.c.run_id == run_id))
        cursor = conn.execute(select(*(c[n] for n in columns)).where(c.run_id == run_id))
        while rows := cursor.fetchmany(SUM_REQUESTS):
            sums, latencies = sums_rows(run_id, columns, rows)
            for name, values in (("request_sums", sums), ("request_latencies", latencies)):
                if values:
                    conn.exec_driver_sql(statements[name].sql, statements[name].params(values))
            done += len(rows)
            if summing is not None:
                summing(run_id, done, total)
        conn.execute(update(schema.runs).where(schema.runs.c.id == run_id).values(request_sums=True))
    return done


def _unfolded_runs(capture: Capture) -> list[int]:
    """The runs with chunks and no stored fold of their summaries that folds every chunk they keep (written
    before version 14, or a run whose retention drop ended its fold)."""
    if not capture.packed.has_tables():
        return []
    c = schema.event_chunks.c
    with capture.engine.connect() as conn:
        last = conn.execute(select(c.run_id, func.max(c.chunk)).group_by(c.run_id).order_by(c.run_id)).fetchall()
        folds = {run_id: capture.packed.fold(int(run_id), capture.schema_version, conn) for run_id, _ in last}
    return [int(r) for r, top in last if (fold := folds[r]) is None or fold.through_chunk < int(top)]


def _fold_runs(
    target: str | Path, engine: Engine, folding: Callable[[int, int, int], None] | None
) -> list[tuple[int, int]]:
    """Store the fold of each unfolded run's chunk summaries (as stored, or computed for a chunk without);
    returns (run, chunks folded) per run."""
    statement = run_summary_statement(engine)
    capture = Capture(target)
    done = []
    try:
        for run_id in _unfolded_runs(capture):
            fold = SummaryFold()
            chunks = capture.packed.summaries(run_id, capture.schema_version)
            for i, chunk in enumerate(chunks.itertuples(index=False), 1):
                per_kind, groups = capture.packed.chunk_summaries(run_id, chunk)
                fold.add(int(chunk.chunk), int(chunk.num_events), per_kind, groups)
                if folding is not None and (i % FOLD_CHUNKS == 0 or i == len(chunks)):
                    folding(run_id, i, len(chunks))
            with engine.begin() as conn:
                conn.exec_driver_sql(statement.sql, statement.params([fold.row(run_id)]))
            done.append((run_id, len(chunks)))
        return done
    finally:
        capture.close()
