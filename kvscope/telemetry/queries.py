"""Read queries over a capture, used by the dashboard, the debugger and the CLI. Each returns
a DataFrame (or plain rows, for the ledger replay).

Readers open the capture read-only (store.open_reader). Aggregation happens in SQL: the
usage series is downsampled to at most `max_points` buckets, events are paged. Every query is
SQLAlchemy Core over the tables of schema.py, read as the file's schema version holds them
(schema.columns_as_of), so the same code reads SQLite and a server database.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
from sqlalchemy import Boolean, ColumnElement, Connection, Engine, Integer, Select, cast, func, literal, select

from kvscope.telemetry import page_checks, schema, store
from kvscope.telemetry.event_source import (
    EVENT_COLUMNS,
    EventFilter,
    PackedEvents,
    chunk_columns,
    last_seq,
    packed_arrays,
    python_values,
    read_events,
    row_columns,
)
from kvscope.telemetry.events import EventKind
from kvscope.telemetry.retention import OverBound, over_bound
from kvscope.telemetry.store import (
    CaptureError,
    display_name,
    distinct_in_key,
    driver_rows,
    open_reader,
    stored_version,
)
from kvscope.telemetry.tree_replay import REPLAY_COLUMNS, STRUCTURAL_KINDS, replay_tree
from kvscope.telemetry.usage_buckets import UsageBuckets, bucket_width

STALE_HEARTBEAT_S = 30.0
RATE_WINDOW_S = 10.0  # latest_usage: how far back the earlier row of a rate is
BEFORE_ANY_STEP = -(1 << 62)  # latest_usage: below every step a run records
SNAPSHOTS_KEPT = 4  # tree snapshots a Capture remembers
ENDED_WITHOUT_CLOSING = "ended without closing"


class PoolsSeen(NamedTuple):
    """Capture._usage_pools's count of a run's usage rows so far: through which step, from which first
    step, and whether an SWA pool and a host tier were seen."""

    lo: int
    through_step: int
    swa: bool
    host: bool


class Capture:
    """A capture opened read-only."""

    def __init__(self, target: str | Path) -> None:
        self.target = str(target)
        self.name = display_name(target)  # NOTE: what messages print: a URL without its password
        path = store.file_of(target)
        # NOTE: a writer's log beside the file when it was opened (close_and_settle folds only those)
        self._writer_log = path is not None and any(Path(f"{path}{end}").exists() for end in ("-wal", "-shm"))
        self.engine: Engine = open_reader(target)
        self.packed = PackedEvents(self.engine, self.target)
        try:
            self.packed.check_structure(with_columns=_small_file(target))
        except BaseException:
            self.engine.dispose()
            raise
        self._snapshots: OrderedDict[tuple[int, int], pd.DataFrame] = OrderedDict()
        self._lock = threading.Lock()
        self._pools_seen: dict[int, PoolsSeen] = {}  # NOTE: per run, _usage_pools's count so far
        self._usage_buckets: dict[tuple[int, int], UsageBuckets] = {}  # NOTE: per run and bucket count, usage's
        # NOTE: every page was checked at open (a small file), or needs no check (a server database)
        self._pages_checked = path is None or _small_file(target)
        self._newest_version_seen = False  # NOTE: a file at this code's newest schema stays there

    def close(self) -> None:
        self.engine.dispose()

    def close_and_settle(self) -> bool:
        """Close, and fold a closed capture file's log back into it (store.settle_file): a reader that
        outlives its writer (a dashboard left open) is then the last to close the file, and only the
        last may turn it back into one file. Nothing is done while a run still records, for a file
        that had no log beside it when it was opened (its writer had closed it), or for a database.
        True when the file was settled."""
        path = store.file_of(self.target)
        try:
            recording = path is not None and (self.runs()["display_status"] == "running").any()
        except Exception:  # NOTE: at exit, on a file that went away or broke: leave it as it is
            recording = True
        self.engine.dispose()
        if path is None or recording or not self._writer_log:
            return False  # NOTE: a file its writer had closed before: left byte for byte as it is
        return store.settle_file(path)

    def check_pages(self) -> None:
        """Before a verdict: SQLite's check of every page of a file too big to check at open, once per
        Capture (store.quick_check). The cheap checks at open (the header's length, tables, columns,
        chunk keys) cannot see a damaged page in the middle, and a verdict read from a stored report
        or from the events alone would not meet one; raises the one-line CaptureError. A file that
        passed before, unchanged since, is not checked again (page_checks.py)."""
        with self._lock:
            if self._pages_checked:
                return
            path = store.file_of(self.target)
            if path is not None and page_checks.passed(path):
                self._pages_checked = True
                return
            try:
                with self.engine.connect() as conn:
                    store.quick_check(conn, self.name)
            except CaptureError:
                if path is not None:
                    page_checks.forget(path)
                raise
            if path is not None:
                page_checks.remember(path)
            self._pages_checked = True

    @property
    def schema_version(self) -> int:
        """The file's schema version now (a writer appending a run upgrades an older file). Read once
        the file is at the newest version this code writes (no writer of ours moves it further, and
        open_reader refuses a newer one), so the run list of a live session costs no second read."""
        if self._newest_version_seen:
            return schema.SCHEMA_VERSION
        with self.engine.connect() as conn:
            version = int(stored_version(conn) or schema.SCHEMA_VERSION)  # open_reader checked it is there
        self._newest_version_seen = version >= schema.SCHEMA_VERSION
        return version

    def read_frame(self, stmt: Select[Any]) -> pd.DataFrame:
        """A Core SELECT's rows as a DataFrame, one column per selected name. NOTE: read through
        the driver: plain tuples, not SQLAlchemy rows (about 4x faster on 100k-row tables)."""
        rows = [row for batch in driver_rows(self.engine, stmt, self.target) for row in batch]
        frame = pd.DataFrame(rows, columns=[c.name for c in stmt.selected_columns])
        for c in stmt.selected_columns:
            if isinstance(c.type, Boolean) and frame[c.name].dtype == bool:
                frame[c.name] = frame[c.name].astype("int64")  # NOTE: PostgreSQL's booleans read as SQLite's 0/1
        return frame

    # -- runs ------------------------------------------------------------------------------

    def runs(self) -> pd.DataFrame:
        r = schema.runs.c
        # NOTE: runs.request_sums is the readers' bookkeeping (has_request_sums), not a property of the run
        columns = [c for c in schema.columns_as_of(schema.runs, self.schema_version) if c.name != "request_sums"]
        frame = self.read_frame(select(*columns).order_by(r.id))
        frame["display_status"] = [display_status(row) for row in frame.itertuples()]
        return frame

    def retention(self) -> pd.DataFrame:
        """Each run's retention row (schema.event_retention: its bounds, the first event it kept,
        what it dropped); empty for a file before version 9 or runs without a bound."""
        with self.engine.connect() as conn:
            if not self.engine.dialect.has_table(conn, schema.event_retention.name):
                return pd.DataFrame(columns=[c.name for c in schema.event_retention.c])
        return self.read_frame(select(schema.event_retention).order_by(schema.event_retention.c.run_id))

    def run_retention(self, run_id: int) -> Any | None:
        """The run's retention row, or None (no bound: nothing was ever dropped)."""
        frame = self.retention()
        found = frame[frame.run_id == run_id]
        return None if found.empty else found.iloc[0]

    def event_bytes(self) -> dict[int, int]:
        """Per run, its kept events' packed bytes (event_chunks.num_bytes; the columns' lengths for
        chunks written before version 9, and for a run of the row layout nothing)."""
        c, k = schema.event_chunks.c, schema.event_columns.c
        if not self.packed.has_tables():
            return {}
        sizes = {}
        with self.engine.connect() as conn:
            has_bytes = self.schema_version >= schema.RETENTION_SINCE
            counted = func.sum(c.num_bytes) if has_bytes else literal(0)
            unknown = func.count() - func.count(c.num_bytes) if has_bytes else func.count()
            rows = conn.execute(select(c.run_id, counted, unknown).group_by(c.run_id)).fetchall()
            for run_id, num_bytes, num_unknown in rows:
                if num_unknown:
                    num_bytes = conn.execute(
                        select(func.sum(func.length(k.data))).where(k.run_id == run_id)
                    ).scalar_one_or_none()
                sizes[int(run_id)] = int(num_bytes or 0)
        return sizes

    def used_bytes(self) -> int | None:
        """The size a size bound counts (retention.py's NOTE): a SQLite file's pages in use; None on
        a server database (a bound there counts the run's own event bytes)."""
        if self.engine.dialect.name != "sqlite":
            return None
        with self.engine.connect() as conn:
            pages, free, page_bytes = (
                int(conn.exec_driver_sql(f"PRAGMA {name}").scalar_one())
                for name in ("page_count", "freelist_count", "page_size")
            )
        return (pages - free) * page_bytes

    def over_bounds(self) -> dict[int, OverBound]:
        """Each run whose size bound the capture is past now, and by what (retention.over_bound)."""
        bounded = self.retention()
        bounded = bounded[bounded.max_bytes.notna()]
        if bounded.empty:
            return {}
        sizes, used = self.event_bytes(), self.used_bytes()
        found = {}
        for row in bounded.itertuples():
            run_id = int(row.run_id)
            own = sizes.get(run_id, 0)
            over = over_bound(
                int(row.max_bytes), own if used is None else used, own if used is None else sum(sizes.values())
            )
            if over is not None:
                found[run_id] = over
        return found

    def ledger_checkpoint(self, run_id: int) -> Any | None:
        """The run's stored ledger state (through_seq, step, producer, body), or None."""
        x = schema.ledger_checkpoints.c
        with self.engine.connect() as conn:
            if not self.engine.dialect.has_table(conn, schema.ledger_checkpoints.name):
                return None
            return conn.execute(select(x.through_seq, x.step, x.producer, x.body).where(x.run_id == run_id)).first()

    def latest_run_id(self) -> int | None:
        with self.engine.connect() as conn:
            return conn.execute(select(func.max(schema.runs.c.id))).scalar_one_or_none()

    # -- series and tables -------------------------------------------------------------------

    def step_range(self, run_id: int) -> pd.DataFrame:
        """One row: the run's first and last step with a usage sample (lo, hi; NULL when none)."""
        u = schema.usage.c
        # NOTE: one subquery each: SQLite reads min() or max() alone from the key's end, but scans the
        # run's every row for both in one SELECT (0.9 s on 850k steps)
        lo = select(func.min(u.step)).where(u.run_id == run_id).scalar_subquery()
        hi = select(func.max(u.step)).where(u.run_id == run_id).scalar_subquery()
        return self.read_frame(select(lo.label("lo"), hi.label("hi")))

    def latest_usage(self, run_id: int, window_s: float = RATE_WINDOW_S) -> pd.DataFrame:
        """The last usage row and the first one at most `window_s` seconds before it (for rates),
        in step order (one row when they are the same)."""
        u = schema.usage.c
        # NOTE: a run's t_mono never decreases with its step (one recorder's monotonic clock), so the last
        # row is the latest and the window starts after the last row older than it: both walk the key
        # (run_id, step) from its end. max(t_mono) and min(step) WHERE t_mono >= ... scanned the run's every
        # row, at every live refresh of every page that shows rates (20 ms at 75k steps, growing with the run)
        latest = select(u.step, u.t_mono).where(u.run_id == run_id).order_by(u.step.desc()).limit(1).subquery()
        last_step = select(latest.c.step).scalar_subquery()
        before = (
            select(u.step)
            .where(u.run_id == run_id, u.t_mono < select(latest.c.t_mono).scalar_subquery() - window_s)
            .order_by(u.step.desc())
            .limit(1)
            .scalar_subquery()
        )
        window_start = select(func.min(u.step)).where(
            u.run_id == run_id, u.step > func.coalesce(before, BEFORE_ANY_STEP)
        )
        columns = [
            _used_of_older().label(c.name) if c.name == "full_used" and self.schema_version < 5 else c
            for c in schema.columns_as_of(schema.usage, self.schema_version)
        ]
        return self.read_frame(
            select(*columns)
            .where(u.run_id == run_id, u.step.in_([last_step, window_start.scalar_subquery()]))
            .order_by(u.step)
        )

    def usage(self, run_id: int, max_points: int = 500) -> pd.DataFrame:
        """Usage per step, at most `max_points` of the run's own rows: the steps are cut into
        buckets and each bucket keeps, for each pool the run has (full, swa, host), the row where
        that pool has the most tokens in use (total - available; the full pool's `full_used` where
        available is NULL), the latest such row on a tie; the run's last row is always kept
        (`max_points` below the number of pools + 1 still gives one bucket).
        NOTE: whole rows, never per-column maxima: a row's pool terms sum to its total, and terms
        taken from different steps do not (their difference can go negative)."""
        u = schema.usage.c
        version = self.schema_version
        has_host = version >= schema.since_version(u.host_total)
        with self.engine.connect() as conn:
            # NOTE: min() and max() each from the key's end (together in one SELECT, SQLite scans the run)
            lo, hi = conn.execute(
                select(
                    select(func.min(u.step)).where(u.run_id == run_id).scalar_subquery(),
                    select(func.max(u.step)).where(u.run_id == run_id).scalar_subquery(),
                )
            ).one()
            if lo is None:
                return pd.DataFrame(columns=[c.name for c in schema.usage.columns])
            has_swa, has_host_rows = self._usage_pools(conn, run_id, lo, hi, has_host)
        peaks = [
            _in_use_full(version),
            *([u.swa_total - u.swa_available] if has_swa else []),
            *([u.host_total - u.host_available] if has_host_rows else []),
        ]
        num_buckets = max(1, (max_points - 1) // len(peaks))
        columns = [
            _used_of_older().label(c.name) if c.name == "full_used" and version < 5 else c
            for c in schema.columns_as_of(schema.usage, version)
            if c.name != "run_id"
        ]
        if bucket_width(hi - lo + 1, num_buckets) == 1:  # NOTE: a bucket per step keeps every row
            return self.read_frame(select(*columns).where(u.run_id == run_id, u.step <= hi).order_by(u.step))
        # NOTE: one aggregate per bucket, not a rank per row (usage_buckets.py: the keys): a ranking window
        # (ROW_NUMBER per bucket) sorted the run's every row with its ranks, 11 s of the Overview at 100 M
        # events (880k steps); and only the buckets the last read of this run left open, so a live refresh
        # aggregates the rows appended since (0.3-0.5 s at 850k steps when it aggregated them all). Steps past
        # `hi` (a live run went on) wait for the next read
        pools, cache_key = (has_swa, has_host_rows), (run_id, num_buckets)
        with self._lock:
            cached = self._usage_buckets.get(cache_key)
        for start_over in (False, True):
            base = cached if cached is not None and not start_over and cached.fits(lo, pools, num_buckets, hi) else None
            buckets = UsageBuckets.empty(lo, pools, num_buckets, hi) if base is None else base.widened(hi)
            offset = u.step - lo
            keys = [func.max(func.coalesce(peak, -1) * buckets.scale + offset) for peak in peaks]
            with self.engine.connect() as conn:
                found = conn.execute(
                    select(*keys)
                    .where(u.run_id == run_id, u.step >= lo + buckets.first_open_offset, u.step <= hi)
                    .group_by(offset // buckets.width)
                ).all()
            buckets = buckets.with_found([tuple(row) for row in found], hi)
            kept = sorted(buckets.steps())
            frame = self.read_frame(select(*columns).where(u.run_id == run_id, u.step.in_(kept)).order_by(u.step))
            if len(frame) == len(kept) or base is None:  # NOTE: else retention thinned a kept peak row away
                break
        with self._lock:
            self._usage_buckets[cache_key] = buckets
        return frame

    def _usage_pools(self, conn: Connection, run_id: int, lo: int, hi: int, has_host: bool) -> tuple[bool, bool]:
        """Whether the run's usage rows through `hi` hold an SWA pool, and a host tier: counted once per
        row, from where the last call on this run stopped (a live run's refresh counts only its new rows;
        counting the run's every row at every refresh cost as much as the downsampling itself). Counted
        afresh when the run's first step moved (retention thinned its rows) or `hi` went back.
        NOTE: a run seen with a pool keeps it for its life: rows are appended, never changed."""
        with self._lock:
            seen = self._pools_seen.get(run_id)
        if seen is None or seen.lo != lo or hi < seen.through_step:
            seen = PoolsSeen(lo, BEFORE_ANY_STEP, False, False)
        if hi > seen.through_step and not (seen.swa and (seen.host or not has_host)):
            u = schema.usage.c
            num_swa, num_host = conn.execute(
                select(func.count(u.swa_total), func.count(u.host_total) if has_host else literal(0)).where(
                    u.run_id == run_id, u.step > seen.through_step, u.step <= hi
                )
            ).one()
            seen = PoolsSeen(lo, hi, seen.swa or bool(num_swa), seen.host or bool(num_host))
        with self._lock:
            self._pools_seen[run_id] = seen
        return seen.swa, seen.host

    def events(
        self,
        run_id: int,
        *,
        kinds: Sequence[EventKind] | None = None,
        rid: str | None = None,
        node_id: int | None = None,
        step_range: tuple[int, int] | None = None,
        limit: int | None = 1000,
        offset: int = 0,
        columns: Sequence[str] = EVENT_COLUMNS,
        rids: Sequence[str] | None = None,
        coded: Sequence[str] = (),
        seqs: Sequence[int] | None = None,
        after_seq: int | None = None,
        before_seq: int | None = None,
    ) -> pd.DataFrame:
        """The run's events in seq order (every column but run_id unless `columns` says), from
        either layout (event_source.py); `limit` None: all of them; `rids`: any of these requests;
        `coded`: these string columns as codes where the run has them (event_source.read_events);
        `seqs`: only the events of these sequence numbers; `after_seq`, `before_seq`: only those after, before it."""
        where = EventFilter.of(
            kinds=kinds,
            after_seq=after_seq,
            before_seq=before_seq,
            rid=rid,
            rids=rids,
            node_id=node_id,
            step_range=step_range,
            limit=limit,
            offset=offset,
            seqs=seqs,
        )
        return read_events(self, run_id, columns, where, coded=coded)

    def event_stream(
        self, run_id: int, columns: Sequence[str], *, after_seq: int = -1, batch_rows: int = 20_000
    ) -> Iterator[list[tuple]]:
        """The run's events after `after_seq` in sequence order, as plain tuples of `columns`
        (names of schema.events), a batch at a time: the ledger replay's path (a DataFrame or
        Row per event costs more than the replay itself)."""
        chunks = self.packed.chunks(run_id)
        if chunks.empty:
            yield from self._row_stream(run_id, columns, after_seq, batch_rows)
            return
        names = ["seq", *(c for c in columns if c != "seq")]
        for chunk in chunks[chunks.first_seq + chunks.num_events - 1 > after_seq].itertuples(index=False):
            arrays = packed_arrays(self.packed, pd.DataFrame([chunk]), run_id, names, EventFilter(after_seq=after_seq))
            values = [python_values(self.packed, run_id, c, arrays[c]) for c in columns]
            rows = list(zip(*values, strict=True))
            for start in range(0, len(rows), batch_rows):
                yield rows[start : start + batch_rows]

    def event_column_stream(self, run_id: int, columns: Sequence[str], *, after_seq: int = -1) -> Iterator[dict]:
        """The run's events after `after_seq` as event_source.chunk_columns arrays, a chunk at a time
        (a run of the row layout: a batch of rows at a time): the ledger replay's bulk path."""
        chunks = self.packed.chunks(run_id)
        if chunks.empty:
            for batch in self._row_stream(run_id, columns, after_seq, 20_000):
                yield row_columns(batch, columns)
            return
        for chunk in chunks[chunks.first_seq + chunks.num_events - 1 > after_seq].itertuples(index=False):
            yield chunk_columns(self.packed, run_id, chunk, columns, after_seq)

    def _row_stream(
        self, run_id: int, columns: Sequence[str], after_seq: int, batch_rows: int
    ) -> Iterator[list[tuple]]:
        e = schema.events.c
        stmt = select(*(e[name] for name in columns)).where(e.run_id == run_id, e.seq > after_seq).order_by(e.seq)
        yield from driver_rows(self.engine, stmt, self.target, batch_rows)

    def last_event_seq(self, run_id: int) -> int:
        """The run's last event seq (-1 when it has none)."""
        return last_seq(self, run_id)

    def stored_report(self, run_id: int, kind: str) -> Any | None:
        """The report row (through_seq, built_at, producer, body) stored with the run, or None
        (none stored, or a capture from before the reports table)."""
        r = schema.reports.c
        with self.engine.connect() as conn:
            if not self.engine.dialect.has_table(conn, schema.reports.name):
                return None
            return conn.execute(
                select(r.through_seq, r.built_at, r.producer, r.body).where(r.run_id == run_id, r.kind == kind)
            ).first()

    def event_counts(self, run_id: int) -> pd.DataFrame:
        """kind, count: the run's events per kind, by kind."""
        counts = self.packed.kind_counts(run_id, self.schema_version)
        if counts:
            return pd.DataFrame(sorted(counts.items()), columns=["kind", "count"])
        e = schema.events.c
        stmt = select(e.kind, func.count().label("count")).where(e.run_id == run_id).group_by(e.kind)
        return self.read_frame(stmt.order_by(e.kind))

    def leak_checks(self, run_id: int) -> pd.DataFrame:
        c = schema.leak_checks.c
        stmt = select(*schema.columns_as_of(schema.leak_checks, self.schema_version))
        return self.read_frame(stmt.where(c.run_id == run_id).order_by(c.step, c.pool))

    def census_blocks(self, run_id: int, step: int | None = None) -> pd.DataFrame:
        """Every block the run's censuses named (CENSUS_BLOCK_COLUMNS), by step, term and block; at
        one step when `step` is given. Empty for a capture from before version 8 (its leak checks'
        messages are all it has)."""
        c = schema.census_blocks.c
        with self.engine.connect() as conn:
            if not self.engine.dialect.has_table(conn, schema.census_blocks.name):
                return pd.DataFrame(columns=list(schema.CENSUS_BLOCK_COLUMNS))
        stmt = select(schema.census_blocks).where(c.run_id == run_id)
        if step is not None:
            stmt = stmt.where(c.step == step)
        return self.read_frame(stmt.order_by(c.step, c.term, c.block))

    def requests(self, run_id: int) -> pd.DataFrame:
        c = schema.requests.c
        stmt = select(*schema.columns_as_of(schema.requests, self.schema_version))
        return self.read_frame(stmt.where(c.run_id == run_id).order_by(c.arrive_step, c.rid))

    def request_rows(
        self,
        run_id: int,
        *,
        principals: Sequence[str] | None = None,
        statuses: Sequence[str] | None = None,
        rid: str | None = None,
        rids: Sequence[str] | None = None,
        columns: Sequence[str] | None = None,
        limit: int | None = None,
        offset: int = 0,
        ordered: bool = True,
        newest_first: bool = False,
    ) -> pd.DataFrame:
        """Requests rows (ordered as requests(): by arrival step, then rid, or the reverse when
        `newest_first`; in no order unless `ordered`), of `principals`, `statuses` or one `rid` when
        given (or any of `rids`), as `columns` (every column by default), a page of `limit` rows past `offset`: a page
        of a run of 300k requests without reading them all."""
        c = schema.requests.c
        as_of = {col.name: col for col in schema.columns_as_of(schema.requests, self.schema_version)}
        picked = [as_of[name] for name in columns] if columns is not None else list(as_of.values())
        stmt = select(*picked).where(c.run_id == run_id)
        if principals is not None:
            stmt = stmt.where(c.principal.in_(list(principals)))
        if statuses is not None:
            stmt = stmt.where(c.status.in_(list(statuses)))
        if rid is not None:
            stmt = stmt.where(c.rid == rid)
        if rids is not None:
            stmt = stmt.where(c.rid.in_(list(rids)))
        if ordered:
            keys = (c.arrive_step.desc(), c.rid.desc()) if newest_first else (c.arrive_step, c.rid)
            stmt = stmt.order_by(*keys)
        stmt = stmt.offset(offset or None)
        return self.read_frame(stmt.limit(limit) if limit is not None else stmt)

    def request_totals(self, run_id: int, principals: Sequence[str] | None = None) -> pd.DataFrame:
        """Per status of the requests (of `principals` when given): requests, prompt tokens,
        cached tokens and retractions (status, num_requests, prompt_tokens, cached_tokens,
        retractions), by status: from the run's request sums where it has them (schema version 12),
        else from its request rows."""
        if self.has_request_sums(run_id):
            c = schema.request_sums.c
            count, prompt, retractions = _int_sum(c.num_requests), c.prompt_tokens, c.retractions
        else:
            c = schema.requests.c
            count, prompt, retractions = func.count(), c.prompt_len, c.num_retractions
        stmt = select(
            c.status,
            count.label("num_requests"),
            _int_sum(prompt).label("prompt_tokens"),
            _int_sum(c.cached_tokens).label("cached_tokens"),
            _int_sum(retractions).label("retractions"),
        ).where(c.run_id == run_id)
        if principals is not None:
            stmt = stmt.where(c.principal.in_(list(principals)))
        return self.read_frame(stmt.group_by(c.status).order_by(c.status))

    def has_request_sums(self, run_id: int) -> bool:
        """Whether every request row of the run is summed in request_sums and request_latencies."""
        if self.schema_version < schema.REQUEST_SUMS_SINCE:
            return False
        r = schema.runs.c
        with self.engine.connect() as conn:
            return bool(conn.execute(select(r.request_sums).where(r.id == run_id)).scalar())

    def request_latency_histograms(self, run_id: int, principals: Sequence[str] | None = None) -> pd.DataFrame | None:
        """The latency histograms of the run's requests (of `principals` when given): latency, bucket,
        num_requests, min_ms, max_ms by latency and bucket (request_sums.py's buckets); None for a run
        without request sums (written before schema version 12 and not upgraded)."""
        if not self.has_request_sums(run_id):
            return None
        c = schema.request_latencies.c
        stmt = select(
            c.latency,
            c.bucket,
            _int_sum(c.num_requests).label("num_requests"),
            func.min(c.min_ms).label("min_ms"),
            func.max(c.max_ms).label("max_ms"),
        ).where(c.run_id == run_id)
        if principals is not None:
            stmt = stmt.where(c.principal.in_(list(principals)))
        return self.read_frame(stmt.group_by(c.latency, c.bucket).order_by(c.latency, c.bucket))

    def first_arrival(self, run_id: int) -> float | None:
        """The earliest monotonic arrival time of the run's requests (None without any)."""
        c = schema.requests.c
        with self.engine.connect() as conn:
            found = conn.execute(select(func.min(c.arrive_t)).where(c.run_id == run_id)).scalar()
        return None if found is None else float(found)

    def request_principals(self, run_id: int) -> list[str]:
        """The distinct principals of the run's requests (no NULL), sorted: one seek per principal through
        ix_requests_principal (schema version 10; SELECT DISTINCT read every request row)."""
        c = schema.requests.c
        if self.schema_version < schema.CHUNK_SUMMARY_SINCE:  # NOTE: no index to hop through: one pass
            stmt = select(c.principal).where(c.run_id == run_id, c.principal.is_not(None)).distinct()
            return sorted(str(p) for p in self.read_frame(stmt).iloc[:, 0])
        with self.engine.connect() as conn:
            return sorted(str(p) for (p,) in conn.execute(distinct_in_key(c.principal, c.run_id == run_id)))

    def snapshot_steps(self, run_id: int) -> list[int]:
        t = schema.tree_snapshots.c
        with self.engine.connect() as conn:
            rows = conn.execute(distinct_in_key(t.step, t.run_id == run_id))  # ix_tree_step
            return [int(s) for (s,) in rows]

    def tree_at(self, run_id: int, step: int) -> pd.DataFrame:
        """The node table at `step`: the latest snapshot at or before it, then the structural
        events after it (insert, split, evict, lock, unlock, tombstone) replayed up to `step`.
        CaptureError when retention dropped events that replay would need (a snapshot at `step`
        itself, one at a leak check, is always there)."""
        t = schema.tree_snapshots.c
        with self.engine.connect() as conn:
            base_step = conn.execute(
                select(func.max(t.step)).where(t.run_id == run_id, t.step <= step)
            ).scalar_one_or_none()
        self._check_kept(run_id, step, base_step)
        nodes = pd.DataFrame(columns=list(schema.TREE_SNAPSHOT_COLUMNS))
        if base_step is not None:
            nodes = self._snapshot(run_id, int(base_step))
        start = -1 if base_step is None else base_step
        events = self.events(
            run_id, kinds=STRUCTURAL_KINDS, step_range=(start + 1, step), limit=None, columns=REPLAY_COLUMNS
        )
        return replay_tree(nodes.drop(columns=["run_id", "step"], errors="ignore"), events)

    def _check_kept(self, run_id: int, step: int, base_step: int | None) -> None:
        kept = self.run_retention(run_id)
        if kept is None or int(kept.first_seq) == 0 or base_step == step:
            return
        first_step = int(kept.first_step)
        if base_step is None or base_step < first_step:
            raise store.CaptureError(
                f"{self.name}: the tree at step {step} cannot be rebuilt: events before step {first_step} were "
                "dropped by retention (the tree is kept at the leak checks' steps, and from that step on)"
            )

    def _snapshot(self, run_id: int, step: int) -> pd.DataFrame:
        """One snapshot's rows, remembered (a snapshot never changes once written): the tree page
        rebuilds two nearby steps, usually from the same snapshot. Callers must not modify it."""
        key = (run_id, step)
        with self._lock:
            if key in self._snapshots:
                self._snapshots.move_to_end(key)
                return self._snapshots[key]
        t = schema.tree_snapshots.c
        columns = schema.columns_as_of(schema.tree_snapshots, self.schema_version)
        # NOTE: in node order on every database (without ORDER BY, SQLite reads them in insertion order and
        # PostgreSQL in whatever order its pages hold)
        nodes = self.read_frame(select(*columns).where(t.run_id == run_id, t.step == step).order_by(t.node_id))
        # NOTE: NULL only in rows written before schema version 3, when every cache shared globally
        nodes["visibility"] = nodes["visibility"].astype(object).where(nodes["visibility"].notna(), "public")
        # NOTE: NULL only in rows written before schema version 4, when every cache had one tier
        nodes["tier"] = nodes["tier"].astype(object).where(nodes["tier"].notna(), "device")
        with self._lock:
            self._snapshots[key] = nodes
            while len(self._snapshots) > SNAPSHOTS_KEPT:
                self._snapshots.popitem(last=False)
        return nodes


def _small_file(target: str | Path) -> bool:
    """A SQLite file small enough for the checks at open to read all of it (store.open_reader's
    quick_check bound)."""
    path = store.file_of(target)
    return path is not None and path.stat().st_size <= store.QUICK_CHECK_MAX_BYTES


def display_status(row: Any) -> str:
    """running / finished / crashed, or 'ended without closing' for a run whose writer died."""
    if row.status != "running":
        return str(row.status)
    pid, heartbeat_at = _number(row.pid), _number(row.heartbeat_at)
    if row.host == socket.gethostname() and pid and not pid_alive(int(pid)):
        return ENDED_WITHOUT_CLOSING
    if heartbeat_at is not None and time.time() - heartbeat_at > STALE_HEARTBEAT_S:
        return ENDED_WITHOUT_CLOSING
    return "running"


def _number(value: Any) -> float | None:
    """A stored number, or None for NULL, NaN or a value that is not one (a hand-edited row)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if number != number else number


def pid_alive(pid: int) -> bool:
    """Whether a process of this id runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_use_full(version: int) -> Any:
    """The full pool's tokens in use (total - available), or `full_used` where an attached
    engine left available NULL (files older than version 5 have no full_used, nor such rows)."""
    u = schema.usage.c
    in_use = u.full_total - u.full_available
    return in_use if version < 5 else func.coalesce(in_use, u.full_used)


def _used_of_older() -> Any:
    """usage.full_used read from a file older than version 5: only engine runs wrote those, and
    their used tokens are total - available - evictable."""
    u = schema.usage.c
    return u.full_total - u.full_available - u.full_evictable


def _int_sum(column: ColumnElement[Any]) -> ColumnElement[Any]:
    """sum() as an integer on every database (PostgreSQL sums a bigint column as numeric)."""
    return cast(func.sum(column), Integer)
