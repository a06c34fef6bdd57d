"""A run's events as columns, from either layout: packed chunks (schema version 6 on,
packed.py) or one `events` row per event (runs written before version 6).

NOTE: what a read returns
    A DataFrame of the asked columns (names of schema.EVENT_COLUMNS; `seq` always first) in
    seq order, the same from both layouts: integers as int64 (node_id as float64 with NaN when
    a NULL is among the rows, as pandas reads a NULL integer column), t_mono as float64,
    strings as pandas reads a text column (a NULL is NaN there; a column of NULLs only is
    objects, None), slots as bytes (int32 little-endian) or None.
    Filters (one EventFilter): kinds, a step range, events after a seq, any of some rids, a
    node id, some seqs; then offset/limit.
NOTE: cost. A packed chunk is immutable once written, so its decoded columns are cached per
(run, chunk, column) up to CACHE_BYTES; a read by kind or step range skips the chunks whose
metadata rules them out, and a live run's new chunks are read as they appear. The filters
are numpy masks over the chunks read, so a read touches at most the run's events once.
NOTE: trust. A run's chunks must cover its seqs from 0 (or from the first event its retention kept:
event_retention.first_seq) without a gap or an overlap, each column
must be of a type packed.narrow writes and hold one value per event (slots: the sum of the
counts), every code must be in the dictionary, and a run without chunks must have no column or
string rows either. Anything else is a damaged capture (CaptureError, one line): events are
missing, and no verdict may be read from what is left.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from sqlalchemy import Engine, func, null, select

from kvscope.telemetry import schema
from kvscope.telemetry.carry import CARRY_FIELDS, MISS_FIELDS, carries, miss_nodes
from kvscope.telemetry.events import EventKind
from kvscope.telemetry.packed import (
    COLUMN_DTYPES,
    GROUP_FOLDS,
    NO_CODE,
    NO_SLOTS,
    NULL_INT,
    STORED_COLUMNS,
    STRING_COLUMNS,
    SUMMARY_FIELDS,
    SummaryFold,
    summaries,
    widen_array,
    writes_dtype,
)
from kvscope.telemetry.store import CaptureError, consistent_reads, distinct_in_key, driver_rows

CACHE_BYTES = 1 << 30
FEW_STRINGS = 256  # NOTE: up to this many codes or texts are looked up by SQL, not by the whole dictionary
EVENT_COLUMNS = tuple(c for c in schema.EVENT_COLUMNS if c != "run_id")


@dataclass(frozen=True)
class EventFilter:
    """Which of a run's events a read keeps (None: any), then which page of them: `offset`
    events skipped, at most `limit` kept (None: all). Build one with `EventFilter.of`, which
    takes kinds as EventKinds or strings, folds one `rid` into `rids`, and sorts `seqs`."""

    kinds: tuple[str, ...] | None = None
    step_range: tuple[int, int] | None = None  # inclusive
    after_seq: int | None = None
    before_seq: int | None = None
    rids: tuple[str, ...] | None = None
    node_id: int | None = None
    seqs: tuple[int, ...] | None = None  # sorted, unique
    limit: int | None = None
    offset: int = 0

    def __post_init__(self) -> None:
        if self.offset < 0 or (self.limit is not None and self.limit < 0):
            raise ValueError(f"an event read's offset and limit are counts: offset {self.offset}, limit {self.limit}")

    @classmethod
    def of(
        cls,
        *,
        kinds: Sequence[Any] | None = None,
        step_range: tuple[int, int] | None = None,
        after_seq: int | None = None,
        before_seq: int | None = None,
        rid: str | None = None,
        rids: Sequence[str] | None = None,
        node_id: int | None = None,
        seqs: Sequence[int] | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> EventFilter:
        """`rid`, when given, replaces `rids`."""
        chosen = [rid] if rid is not None else rids
        return cls(
            None if kinds is None else tuple(str(k) for k in kinds),
            step_range,
            after_seq,
            before_seq,
            None if chosen is None else tuple(chosen),
            node_id,
            None if seqs is None else tuple(sorted({int(q) for q in seqs})),
            limit,
            offset,
        )


ALL_EVENTS = EventFilter()
SUMMARY_COLUMNS = ("chunk", "num_events", "kind_counts", "groups")
CARRY_COLUMNS = (
    "chunk",
    "first_seq",
    "num_events",
    "first_step",
    "last_step",
    "evict_steps",
    "lock_carry",
    "request_carry",
    "miss_nodes",
)


class _Codes(NamedTuple):
    """A filter's strings as a packed run's codes, resolved once per read."""

    kinds: np.ndarray | None
    rids: np.ndarray | None
    seqs: np.ndarray | None


class _Dictionary:
    """A run's strings: `lookup[code + 1]` is the text of a code (slot 0: NO_CODE, None), and
    `inverse` the code of a text; `defined[code + 1]` says a code's row was read. NOTE: retention
    deletes the strings of the chunks it drops (packed.StringCodes), so the codes read may skip
    some (from the first too); a chunk kept uses none of those, and a code used again is written
    again under the same number."""

    def __init__(self) -> None:
        self.lookup = np.full(1, None, dtype=object)
        self.defined = np.ones(1, bool)
        self.inverse: dict[str, int] = {}

    @property
    def size(self) -> int:
        return len(self.lookup) - 1

    def extend(self, rows: Sequence[Any]) -> None:
        if not rows:
            return
        codes = np.asarray([int(code) for code, _text in rows], np.int64)
        texts = [str(text) for _code, text in rows]
        if int(codes.min()) < 0:
            raise CaptureError(f"damaged capture (the run's string code {int(codes.min())} is out of range)")
        top = int(codes.max())
        if top >= self.size:
            grown = top + 2 - len(self.lookup)
            self.lookup = np.concatenate([self.lookup, np.full(grown, None, dtype=object)])
            self.defined = np.concatenate([self.defined, np.zeros(grown, bool)])
        self.lookup[codes + 1] = np.asarray(texts, dtype=object)
        self.defined[codes + 1] = True
        self.inverse.update(zip(texts, codes.tolist(), strict=True))

    def undefined(self, codes: np.ndarray) -> np.ndarray:
        """The distinct codes among `codes` (NO_CODE and up, each below `size`) not read yet."""
        return np.unique(codes[~self.defined[codes.astype(np.int64) + 1]])


class PackedEvents:
    """The decoded chunks of a capture's packed runs (shared by every read of one Capture)."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name  # NOTE: the capture as error lines name it
        self._lock = threading.Lock()
        self._columns: OrderedDict[tuple[int, int, str], np.ndarray] = OrderedDict()
        self._bytes = 0
        self._strings: dict[int, _Dictionary] = {}
        self._known_codes: dict[int, dict[str, int]] = {}  # NOTE: codes looked up by text, before any dictionary
        self._has_tables: bool | None = None

    def has_tables(self) -> bool:
        if self._has_tables is None:
            with self.engine.connect() as conn:
                self._has_tables = self.engine.dialect.has_table(conn, schema.event_chunks.name)
        return self._has_tables

    def chunks(self, run_id: int) -> pd.DataFrame:
        """The run's chunks (chunk, first_seq, num_events, first_step, last_step, kinds), in
        seq order, checked to cover seqs 0 .. last without a gap; empty for a run of the row
        layout."""
        c = schema.event_chunks.c
        if not self.has_tables():
            return pd.DataFrame(columns=["chunk", "first_seq", "num_events", "first_step", "last_step", "kinds"])
        with consistent_reads(self.engine) as conn:  # NOTE: the retention pass drops chunks meanwhile
            rows = conn.execute(
                select(c.chunk, c.first_seq, c.num_events, c.first_step, c.last_step, c.kinds)
                .where(c.run_id == run_id)
                .order_by(c.first_seq)
            ).fetchall()
            first_kept = self._first_kept(conn).get(run_id, 0)
        frame = pd.DataFrame(
            [tuple(r) for r in rows], columns=["chunk", "first_seq", "num_events", "first_step", "last_step", "kinds"]
        )
        if frame.empty:
            self._check_no_parts(run_id)
        else:
            self._check_contiguous(run_id, frame, first_kept)
        return frame

    def has_chunks(self, run_id: int) -> bool:
        """Whether the run's events are packed (it has a chunk): one index seek, not `chunks`' read of every chunk
        row (0.07 s at 100 M events) to ask whether there is one; opening the capture checked them (check_structure)."""
        if not self.has_tables():
            return False
        c = schema.event_chunks.c
        with self.engine.connect() as conn:
            return conn.execute(select(c.chunk).where(c.run_id == run_id).limit(1)).first() is not None

    def _first_kept(self, conn: Any) -> dict[int, int]:
        """Per run that dropped events by retention, the first event it kept (schema version 9)."""
        r = schema.event_retention
        if not self.engine.dialect.has_table(conn, r.name):
            return {}
        return {int(run): int(seq) for run, seq in conn.execute(select(r.c.run_id, r.c.first_seq))}

    def check_structure(self, *, with_columns: bool) -> None:
        """Every packed run's chunks against their column and string rows (see the trust note),
        so a capture damaged there is refused when it is opened, before any page or verdict reads
        it. The chunk rows and the columns' keys (an index) are always checked; each column's type
        and length only `with_columns` (a small file: a large one's reads check what they read)."""
        if not self.has_tables():
            return
        c, k, s = schema.event_chunks.c, schema.event_columns.c, schema.event_strings.c
        with consistent_reads(self.engine) as conn:  # NOTE: a live writer commits chunks meanwhile
            chunks = pd.DataFrame(
                conn.execute(
                    select(c.run_id, c.chunk, c.first_seq, c.num_events).order_by(c.run_id, c.first_seq)
                ).fetchall(),
                columns=["run_id", "chunk", "first_seq", "num_events"],
            )
            keys = conn.execute(
                select(k.run_id, k.chunk, func.count()).where(k.name.in_(STORED_COLUMNS)).group_by(k.run_id, k.chunk)
            ).fetchall()
            string_runs = {int(r) for (r,) in conn.execute(distinct_in_key(s.run_id))}
            first_kept = self._first_kept(conn)
            columns = (
                conn.execute(select(k.run_id, k.chunk, k.name, k.dtype, func.length(k.data))).fetchall()
                if with_columns
                else []
            )
        for run_id, frame in chunks.groupby("run_id"):
            self._check_contiguous(int(run_id), frame, first_kept.get(int(run_id), 0))
        counts = {
            (int(r), int(ch)): int(n) for r, ch, n in zip(chunks.run_id, chunks.chunk, chunks.num_events, strict=True)
        }
        self._check_keys(counts, {(int(r), int(ch)): int(n) for r, ch, n in keys}, string_runs)
        for run_id, chunk, name, stored, num_bytes in columns:
            self._check_column(
                int(run_id), int(chunk), str(name), str(stored), int(num_bytes or 0), counts[(int(run_id), int(chunk))]
            )

    def _check_keys(
        self, counts: dict[tuple[int, int], int], num_columns: dict[tuple[int, int], int], string_runs: set[int]
    ) -> None:
        """Each chunk has all its columns, each column a chunk, each run's strings a chunk."""
        orphan = min(set(num_columns) - set(counts), default=None)
        if orphan is not None:
            raise self.damaged(
                orphan[0], f"event chunk {orphan[1]} has columns but no event_chunks row: events are missing"
            )
        short = min((key for key in counts if num_columns.get(key, 0) != len(STORED_COLUMNS)), default=None)
        if short is not None:
            raise self.damaged(
                short[0], f"event chunk {short[1]} has {num_columns.get(short, 0)} of its {len(STORED_COLUMNS)} columns"
            )
        orphans = string_runs - {r for r, _ in counts}
        if orphans:
            raise self.damaged(min(orphans), "its event strings are there but no event_chunks row: events are missing")

    def _check_column(self, run_id: int, chunk: int, name: str, stored: str, num_bytes: int, num_events: int) -> None:
        if name not in COLUMN_DTYPES:
            return  # NOTE: a column this kvscope does not read
        if not writes_dtype(name, stored):
            raise self.damaged(
                run_id, f"event chunk {chunk}'s {name} column has type {stored!r}, which kvscope never writes"
            )
        size = np.dtype(stored).itemsize
        if num_bytes % size or (name != "slots" and num_bytes // size != num_events):
            raise self.damaged(
                run_id, f"event chunk {chunk} holds {num_bytes} bytes of {stored} {name} values for {num_events} events"
            )

    def damaged(self, run_id: int, what: str) -> CaptureError:
        return CaptureError(f"{self.name}: damaged capture (run {run_id}: {what})")

    def _check_contiguous(self, run_id: int, frame: pd.DataFrame, first_kept: int = 0) -> None:
        first = frame.first_seq.to_numpy(np.int64)
        counts = frame.num_events.to_numpy(np.int64)
        expected = first_kept + np.concatenate([[0], np.cumsum(counts)[:-1]])
        wrong = np.flatnonzero((first != expected) | (counts < 0))
        if len(wrong):
            i = int(wrong[0])
            raise self.damaged(
                run_id,
                f"event chunk {int(frame.chunk.iloc[i])} starts at seq {int(first[i])} "
                f"with {int(counts[i])} events, where seq {int(expected[i])} was due: "
                "events are missing",
            )

    def _check_no_parts(self, run_id: int) -> None:
        """A run without chunks has no packed columns or strings (else its chunk rows are lost)."""
        with self.engine.connect() as conn:
            for table in (schema.event_columns, schema.event_strings):
                if conn.execute(select(table.c.run_id).where(table.c.run_id == run_id).limit(1)).first():
                    raise self.damaged(
                        run_id, f"its events' {table.name} rows are there but no event_chunks row: events are missing"
                    )

    def event_values(self, run_id: int, chunk: Any, name: str) -> np.ndarray:
        """Column `name` of a chunk (a row of `chunks`) as stored, checked to hold one value per
        event (slots: as many as the chunk's slot counts add up to)."""
        values = self.stored(run_id, int(chunk.chunk), name)
        expected = int(chunk.num_events)
        if name == "slots":
            expected = int(np.maximum(self.event_values(run_id, chunk, "slot_counts"), 0).sum())
        if len(values) != expected:
            raise self.damaged(
                run_id, f"event chunk {int(chunk.chunk)} holds {len(values)} {name} values where {expected} are due"
            )
        return values

    def column(self, run_id: int, chunk: int, name: str) -> np.ndarray:
        """A chunk's column as COLUMN_DTYPES[name]."""
        return widen_array(name, self.stored(run_id, chunk, name))

    def stored(self, run_id: int, chunk: int, name: str) -> np.ndarray:
        """A chunk's column as stored (the narrowest type that holds it: packed.narrow), a view
        of the bytes read; widen what you keep with packed.widen_array."""
        key = (run_id, chunk, name)
        with self._lock:
            found = self._columns.get(key)
            if found is not None:
                self._columns.move_to_end(key)
                return found
        self.prefetch(run_id, [chunk], [name])
        with self._lock:
            found = self._columns.get(key)
        if found is None:
            raise self.damaged(run_id, f"event chunk {chunk} has no {name} column")
        return found

    def prefetch(self, run_id: int, chunks: Sequence[int], names: Sequence[str]) -> None:
        """Read the columns `names` of `chunks` that are not cached yet, in one read (a page of a
        10M-event run needs a few columns of each of its ~150 chunks)."""
        with self._lock:
            missing = sorted(
                {int(chunk) for chunk in chunks for name in names if (run_id, int(chunk), name) not in self._columns}
            )
        if not missing:
            return
        c = schema.event_columns.c
        stmt = select(c.chunk, c.name, c.dtype, c.data).where(
            c.run_id == run_id, c.chunk.between(missing[0], missing[-1]), c.name.in_(list(names))
        )
        wanted = set(missing)
        for rows in driver_rows(self.engine, stmt, self.name, batch_rows=64, binary=True):
            for chunk, name, stored, data in rows:
                if chunk in wanted:
                    self._keep(
                        (run_id, int(chunk), str(name)), self._decoded(run_id, chunk, str(name), str(stored), data)
                    )

    def _decoded(self, run_id: int, chunk: int, name: str, stored: str, data: bytes) -> np.ndarray:
        if not writes_dtype(name, stored):
            raise self.damaged(
                run_id, f"event chunk {chunk}'s {name} column has type {stored!r}, which kvscope never writes"
            )
        if not isinstance(data, bytes) or len(data) % np.dtype(stored).itemsize:
            raise self.damaged(run_id, f"event chunk {chunk}'s {name} column is not a whole number of {stored} values")
        return np.frombuffer(data, stored)

    def _keep(self, key: tuple[int, int, str], values: np.ndarray) -> None:
        with self._lock:
            if key in self._columns:
                return
            self._columns[key] = values
            self._bytes += values.nbytes
            while self._bytes > CACHE_BYTES and len(self._columns) > 1:
                _, dropped = self._columns.popitem(last=False)
                self._bytes -= dropped.nbytes

    def _dictionary(self, run_id: int, *, refresh: bool = False) -> _Dictionary:
        """The run's strings; `refresh` reads the ones defined since (a live run adds some)."""
        found = self._strings.get(run_id)
        if found is None:
            found = self._strings[run_id] = _Dictionary()
            refresh = True
        if refresh and self.has_tables():
            s = schema.event_strings.c
            stmt = select(s.code, s.text).where(s.run_id == run_id, s.code >= found.size).order_by(s.code)
            for rows in driver_rows(self.engine, stmt, self.name):
                try:
                    found.extend(rows)
                except CaptureError as err:  # NOTE: _Dictionary does not know the capture's name
                    raise CaptureError(f"{self.name}: {err}") from err
        return found

    def strings(self, run_id: int, codes: np.ndarray) -> np.ndarray:
        """Codes as an object array of their strings (None for NO_CODE). NOTE: a few codes are
        looked up one by one; many read the run's whole dictionary once (a 10M-event run holds
        hundreds of thousands of request ids)."""
        found = self._strings.get(run_id)
        top = int(codes.max()) if len(codes) else NO_CODE
        if len(codes) and int(codes.min()) < NO_CODE:
            raise self.damaged(run_id, f"a string code {int(codes.min())} is out of range")
        if found is None or top >= found.size:
            # NOTE: the distinct codes in O(n) (codes are dense from 0): a few are looked up alone
            present = np.flatnonzero(np.bincount(codes.astype(np.int64) + 1, minlength=1)) - 1
            if len(present) <= FEW_STRINGS:
                return self._few_strings(run_id, present, top)[codes.astype(np.int64) + 1]
            found = self._dictionary(run_id, refresh=True)
            if top >= found.size:
                raise self.damaged(run_id, f"no string for code {top}")
        missing = found.undefined(codes)
        if len(missing):  # NOTE: written again after this dictionary was read (retention), or missing
            found.extend(self._rows_of(run_id, missing.tolist()))
            if len(found.undefined(missing)):
                raise self.damaged(run_id, f"no string for code {int(found.undefined(missing)[0])}")
        return found.lookup[codes.astype(np.int64) + 1]

    def _rows_of(self, run_id: int, codes: list[int]) -> list[Any]:
        s = schema.event_strings.c
        with self.engine.connect() as conn:
            return list(conn.execute(select(s.code, s.text).where(s.run_id == run_id, s.code.in_(codes))).fetchall())

    def codes_of(self, run_id: int, texts: Sequence[str]) -> list[int]:
        """The codes of `texts` in the run's dictionary (a text the run never used has none)."""
        found = self._strings.get(run_id)
        if found is None and len(texts) <= FEW_STRINGS:
            return self._few_codes(run_id, texts)
        if found is None or any(t not in found.inverse for t in texts):
            found = self._dictionary(run_id, refresh=True)
        return [found.inverse[t] for t in texts if t in found.inverse]

    def _few_strings(self, run_id: int, present: np.ndarray, top: int) -> np.ndarray:
        """A lookup (index code + 1) holding the texts of the `present` codes only."""
        wanted = [int(c) for c in present.tolist() if c != NO_CODE]
        known = dict(self._rows_of(run_id, wanted))
        lookup = np.full(top + 2, None, dtype=object)
        for code in wanted:
            if code not in known:
                raise CaptureError(f"{self.name}: damaged capture (no string for code {code} of run {run_id})")
            lookup[code + 1] = str(known[code])
        return lookup

    def _few_codes(self, run_id: int, texts: Sequence[str]) -> list[int]:
        known = self._known_codes.setdefault(run_id, {})
        missing = [t for t in texts if t not in known]
        if missing:  # NOTE: a text the run does not have yet is asked again next time (a live run adds some)
            s = schema.event_strings.c
            with self.engine.connect() as conn:
                known.update(
                    conn.execute(select(s.text, s.code).where(s.run_id == run_id, s.text.in_(missing))).fetchall()
                )
        return [int(known[t]) for t in texts if t in known]

    def summaries(self, run_id: int, version: int, after_chunk: int = -1, conn: Any = None) -> pd.DataFrame:
        """The run's chunks (numbered past `after_chunk`) with their summaries (chunk, num_events, kind_counts,
        groups: JSON, None in a chunk written before schema version 10), in seq order; empty for the row layout."""
        if not self.has_tables():
            return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
        as_of = {col.name: col for col in schema.columns_as_of(schema.event_chunks, version)}
        c = schema.event_chunks.c
        stmt = select(*(as_of[name] for name in SUMMARY_COLUMNS)).where(c.run_id == run_id, c.chunk > after_chunk)
        if conn is None:
            with self.engine.connect() as own:
                rows = own.execute(stmt.order_by(c.first_seq)).fetchall()
        else:
            rows = conn.execute(stmt.order_by(c.first_seq)).fetchall()
        return pd.DataFrame([tuple(r) for r in rows], columns=list(SUMMARY_COLUMNS))

    def kind_counts(self, run_id: int, version: int) -> dict[str, int]:
        """Events per kind over the run's chunks (empty for a run of the row layout), from their
        summaries (each_summary)."""
        total: dict[str, int] = {}
        for per_kind, _groups in self.each_summary(run_id, version):
            for name, count in per_kind.items():
                total[name] = total.get(name, 0) + int(count)
        return total

    def grouped(self, run_id: int, version: int, name: str) -> list[list[Any]]:
        """Rows of one group of the run's summaries (packed.summaries' NOTE), as each_summary gives them: a
        key may have several rows (a caller adds them up, or takes their least and greatest)."""
        return [row for _per_kind, groups in self.each_summary(run_id, version) for row in groups.get(name, [])]

    def each_summary(self, run_id: int, version: int) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """The run's summaries, (kind_counts, groups), parsed: its stored fold (schema version 14), when it still
        describes the run's chunks, then each chunk after it (a live run's last few); else each chunk's."""
        with consistent_reads(self.engine) as conn:  # NOTE: the fold and the chunks after it from one commit
            fold = self.fold(run_id, version, conn)
            chunks = self.summaries(run_id, version, -1 if fold is None else fold.through_chunk, conn)
        if fold is not None:
            yield fold.kind_counts, {name: fold.rows(name) for name in GROUP_FOLDS}
        for chunk in chunks.itertuples(index=False):
            yield self.chunk_summaries(run_id, chunk)

    def fold(self, run_id: int, version: int, conn: Any) -> SummaryFold | None:
        """The run's stored fold of its chunks' summaries (run_summaries), or None: none stored (a file or run
        written before version 14, or no chunks), or the chunks kept up to its through_chunk are no longer what
        it folds (retention dropped some: a stored fold cannot take them out)."""
        if version < schema.RUN_SUMMARIES_SINCE or not self.has_tables():
            return None
        f, c = schema.run_summaries.c, schema.event_chunks.c
        row = conn.execute(select(schema.run_summaries).where(f.run_id == run_id)).first()
        if row is None:
            return None
        kept = select(func.count(), func.coalesce(func.sum(c.num_events), 0))
        count, events = conn.execute(kept.where(c.run_id == run_id, c.chunk <= row.through_chunk)).one()
        if int(count) != int(row.num_chunks) or int(events) != int(row.num_events):
            return None
        try:
            return SummaryFold.of_row(row)
        except (ValueError, TypeError, KeyError, IndexError) as err:
            raise self.damaged(run_id, "its folded summaries (run_summaries) are not what kvscope writes") from err

    def chunk_summaries(self, run_id: int, chunk: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """A chunk's (a row of `summaries`) summaries, parsed: as stored, or (a chunk written before
        version 10) computed from its columns."""
        if pd.isna(chunk.kind_counts) or pd.isna(chunk.groups):  # NOTE: NULL reads as None or NaN
            stored = self.computed_summaries(run_id, chunk)
        else:
            stored = (chunk.kind_counts, chunk.groups)
        try:
            per_kind, groups = json.loads(stored[0]), json.loads(stored[1])
        except ValueError:
            per_kind = groups = None
        if not isinstance(per_kind, dict) or not isinstance(groups, dict):
            raise self.damaged(run_id, f"event chunk {int(chunk.chunk)}'s summaries are not what kvscope writes")
        return per_kind, groups

    def carried(self, run_id: int, version: int, name: str, steps: tuple[int, int] | None = None) -> pd.DataFrame:
        """The run's chunks (in `steps`, inclusive: those with an event in it) with one of their carries
        (carry.py: evict_steps, lock_carry, request_carry or miss_nodes), in seq order: chunk,
        first_seq, num_events, first_step, last_step and `name`, as stored, or (a chunk written before
        schema version 11, or 13 for miss_nodes) computed from its columns. Empty for the row layout."""
        columns = ["chunk", "first_seq", "num_events", "first_step", "last_step", name]
        if not self.has_tables():
            return pd.DataFrame(columns=columns)
        as_of = {col.name: col for col in schema.columns_as_of(schema.event_chunks, version)}
        c = schema.event_chunks.c
        stored = [as_of[n] if n in as_of else null().label(n) for n in columns]  # NOTE: a file older than the carry
        stmt = select(*stored).where(c.run_id == run_id).order_by(c.first_seq)
        if steps is not None:
            stmt = stmt.where(c.last_step >= steps[0], c.first_step <= steps[1])
        # NOTE: binary: a carry is a bytea (PostgreSQL would send it as hex text, twice its bytes)
        rows = [row for batch in driver_rows(self.engine, stmt, self.name, binary=True) for row in batch]
        frame = pd.DataFrame(rows, columns=columns)
        missing = frame[name].isna().to_numpy()
        if missing.any():
            frame.loc[missing, name] = pd.Series(
                self.computed_carry(run_id, frame[missing], name), index=frame.index[missing], dtype=object
            )
        return frame

    def computed_carry(self, run_id: int, chunks: pd.DataFrame, name: str) -> list[bytes]:
        """One carry of each of `chunks` (rows with chunk and first_seq), from their stored columns. NOTE: miss_nodes
        alone reads three columns, not all of CARRY_FIELDS."""
        if name == "miss_nodes":
            self.prefetch(run_id, chunks.chunk.tolist(), list(MISS_FIELDS))
            match = self.code_of(run_id, EventKind.MATCH.value)
            out = []
            for chunk in chunks.itertuples(index=False):
                values = {n: widen_array(n, self.event_values(run_id, chunk, n)) for n in MISS_FIELDS}
                out.append(miss_nodes(values, values["kind"] == (-2 if match is None else match)))
            return out
        index = CARRY_COLUMNS.index(name) - len(CARRY_COLUMNS)
        self.prefetch(run_id, chunks.chunk.tolist(), list(CARRY_FIELDS))
        return [self.computed_carries(run_id, chunk)[index] for chunk in chunks.itertuples(index=False)]

    def computed_carries(self, run_id: int, chunk: Any) -> tuple[bytes, bytes, bytes, bytes]:
        """carry.carries of a chunk (a row of `carried`, `summaries` or `chunks`: with first_seq), from
        its stored columns."""
        columns = {name: widen_array(name, self.event_values(run_id, chunk, name)) for name in CARRY_FIELDS}
        return carries(columns, int(chunk.first_seq), lambda text: self.code_of(run_id, text))

    def code_of(self, run_id: int, text: str) -> int | None:
        """The code of one text in the run's dictionary (None: the run never used it)."""
        found = self.codes_of(run_id, [text])
        return found[0] if found else None

    def computed_summaries(self, run_id: int, chunk: Any) -> tuple[str, str]:
        """packed.summaries of a chunk (a row of `summaries` or `chunks`), from its stored columns."""
        columns = {name: self.event_values(run_id, chunk, name) for name in SUMMARY_FIELDS}

        def code_of(kind: str) -> int | None:
            found = self.codes_of(run_id, [kind])
            return found[0] if found else None

        return summaries(columns, code_of, lambda codes: [str(s) for s in self.strings(run_id, codes)])


def read_events(
    capture: Any,
    run_id: int,
    columns: Sequence[str] = EVENT_COLUMNS,
    where: EventFilter = ALL_EVENTS,
    *,
    coded: Sequence[str] = (),
) -> pd.DataFrame:
    """`capture`: a queries.Capture. See the module note. `coded`: string columns of a packed run
    that stay int codes (NO_CODE for NULL), for reads that group or join on them and decode only
    what they return (decode_strings); a run of the row layout has its strings either way."""
    names = ["seq", *(c for c in columns if c != "seq")]
    unknown = set(names) - set(EVENT_COLUMNS)
    if unknown:
        raise ValueError(f"not event columns: {sorted(unknown)}")
    packed: PackedEvents = capture.packed
    chunks = packed.chunks(run_id)
    if chunks.empty:
        return _rows(capture, run_id, names, where)
    out = packed_arrays(packed, _chunks_that_may_pass(chunks, where), run_id, names, where)
    return _frame(packed, run_id, out, names, coded)


def _chunks_that_may_pass(chunks: pd.DataFrame, where: EventFilter) -> pd.DataFrame:
    """The chunks whose metadata (kinds, steps, seqs) does not rule out every event `where` keeps."""
    if where.kinds is not None:
        wanted = set(where.kinds)
        chunks = chunks[[bool(wanted & set(k.split(","))) for k in chunks.kinds]]
    if where.step_range is not None:
        chunks = chunks[(chunks.last_step >= where.step_range[0]) & (chunks.first_step <= where.step_range[1])]
    if where.after_seq is not None:
        chunks = chunks[chunks.first_seq + chunks.num_events - 1 > where.after_seq]
    if where.before_seq is not None:
        chunks = chunks[chunks.first_seq < where.before_seq]
    if where.seqs is not None:
        wanted_seqs = np.asarray(where.seqs, np.int64)
        ends = (chunks.first_seq + chunks.num_events).to_numpy()
        hit = np.searchsorted(wanted_seqs, chunks.first_seq.to_numpy()) < np.searchsorted(wanted_seqs, ends)
        chunks = chunks[hit]
    return chunks


def decode_strings(capture: Any, run_id: int, values: Any) -> np.ndarray:
    """A string column read with `coded` as strings (None for NULL): codes of a packed run
    decoded, strings of a row-layout run as they are."""
    array = np.asarray(values)
    if array.dtype.kind in "iu":
        return capture.packed.strings(run_id, array)
    return np.asarray([None if v is None or v != v else v for v in array.tolist()], dtype=object)  # NOTE: NaN != NaN


def present(values: pd.Series) -> pd.Series:
    """A string column (strings, or codes read with `coded`) is not NULL."""
    return values != NO_CODE if values.dtype.kind in "iu" else values.notna()


def packed_arrays(
    packed: PackedEvents, chunks: pd.DataFrame, run_id: int, names: list[str], where: EventFilter = ALL_EVENTS
) -> dict[str, np.ndarray]:
    """The stored arrays of `names` (strings as codes, node_id with NULL_INT) of the events of
    `chunks` that pass `where`; chunks are read one at a time and only until `limit` rows past
    `offset` are found."""
    end = None if where.limit is None else where.offset + where.limit
    parts: list[dict[str, np.ndarray]] = []
    found = 0
    # NOTE: codes resolved once (the chunks were listed first, and a chunk's strings land with it)
    codes = _Codes(
        None if where.kinds is None else np.asarray(packed.codes_of(run_id, list(where.kinds)), np.int32),
        None if where.rids is None else np.asarray(packed.codes_of(run_id, list(where.rids)), np.int32),
        None if where.seqs is None else np.asarray(where.seqs, np.int64),
    )
    if end is None:  # NOTE: every chunk is read: its filter columns and `names` in one read
        filters = [
            n
            for n, wanted in (
                ("kind", where.kinds),
                ("step", where.step_range),
                ("rid", where.rids),
                ("node_id", where.node_id),
            )
            if wanted is not None
        ]
        packed.prefetch(run_id, chunks.chunk.tolist(), [*filters, *_stored(names)])
    for row in chunks.itertuples(index=False):
        part = _chunk_frame(packed, run_id, row, names, where, codes)
        if len(part["seq"]):
            parts.append(part)
            found += len(part["seq"])
        if end is not None and found >= end:
            break
    out = {name: np.concatenate([p[name] for p in parts]) if parts else _empty(name) for name in names}
    return {name: values[where.offset : end] for name, values in out.items()}


def _stored(names: Sequence[str]) -> list[str]:
    """The stored columns behind `names` (seq is computed; slots need their counts)."""
    out = [n for n in names if n not in ("seq", "slots")]
    return [*out, "slot_counts", "slots"] if "slots" in names else out


def python_values(packed: PackedEvents, run_id: int, name: str, values: np.ndarray) -> list[Any]:
    """A stored array as plain Python values, as the row layout's driver returns them (None for
    NULL)."""
    if name in STRING_COLUMNS:
        return list(packed.strings(run_id, values).tolist())
    if name == "node_id":
        return [None if v == NULL_INT else v for v in values.tolist()]
    return list(values.tolist())


def chunk_columns(
    packed: PackedEvents, run_id: int, chunk: Any, names: Sequence[str], after_seq: int
) -> dict[str, np.ndarray]:
    """The events of one chunk (a row of `chunks`) after `after_seq` as arrays: `seq`, the string
    columns as objects (None for NULL), node_id with NULL_INT, and for `slots` the events'
    `slot_counts` (NO_SLOTS: none) with all their `slots` end to end as int64."""
    skip = max(0, after_seq - int(chunk.first_seq) + 1)
    n = int(chunk.num_events)
    out: dict[str, np.ndarray] = {"seq": np.arange(int(chunk.first_seq) + skip, int(chunk.first_seq) + n)}
    packed.prefetch(run_id, [int(chunk.chunk)], _stored(names))
    for name in names:
        if name == "slots":
            counts = widen_array("slot_counts", packed.event_values(run_id, chunk, "slot_counts"))
            slots = widen_array("slots", packed.event_values(run_id, chunk, "slots")).astype(np.int64)
            out["slot_counts"] = counts[skip:]
            out["slots"] = slots[int(np.maximum(counts[:skip], 0).sum()) :]
        elif name in STRING_COLUMNS:
            out[name] = packed.strings(run_id, packed.event_values(run_id, chunk, name)[skip:])
        elif name != "seq":
            out[name] = widen_array(name, packed.event_values(run_id, chunk, name)[skip:])
    return out


def row_columns(rows: Sequence[Sequence[Any]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Rows of `names` (a run of the row layout, slots as blobs) as chunk_columns arrays."""
    out: dict[str, np.ndarray] = {}
    for i, name in enumerate(names):
        values = [row[i] for row in rows]
        if name == "slots":
            out["slot_counts"] = np.asarray([NO_SLOTS if v is None else len(v) // 4 for v in values], np.int64)
            out["slots"] = np.frombuffer(b"".join(v for v in values if v), "<i4").astype(np.int64)
        elif name in STRING_COLUMNS:
            out[name] = np.asarray(values, dtype=object)
        elif name == "node_id":
            out[name] = np.asarray([NULL_INT if v is None else v for v in values], np.int64)
        else:
            out[name] = np.asarray(values, np.float64 if name == "t_mono" else np.int64)
    return out


def _chunk_frame(
    packed: PackedEvents, run_id: int, row: Any, names: list[str], where: EventFilter, codes: _Codes
) -> dict[str, np.ndarray]:
    def col(name: str) -> np.ndarray:  # NOTE: as stored (narrow): filtered first, widened when kept
        return packed.event_values(run_id, row, name)

    n = int(row.num_events)
    mask = np.ones(n, bool)
    step_range, after_seq, seqs = where.step_range, where.after_seq, codes.seqs
    if codes.kinds is not None:
        mask &= np.isin(col("kind"), codes.kinds)
    if step_range is not None and not (step_range[0] <= row.first_step and row.last_step <= step_range[1]):
        step = col("step")
        mask &= (step >= step_range[0]) & (step <= step_range[1])
    if after_seq is not None and after_seq >= row.first_seq:
        mask[: after_seq - int(row.first_seq) + 1] = False
    if where.before_seq is not None and where.before_seq < row.first_seq + n:
        mask[max(0, where.before_seq - int(row.first_seq)) :] = False
    if seqs is not None:  # NOTE: sorted; the chunk holds seqs first_seq .. first_seq + n - 1
        first = int(row.first_seq)
        inside = seqs[(seqs >= first) & (seqs < first + n)] - first
        picked = np.zeros(n, bool)
        picked[inside] = True
        mask &= picked
    if codes.rids is not None:
        mask &= np.isin(col("rid"), codes.rids)
    if where.node_id is not None:
        mask &= widen_array("node_id", col("node_id")) == where.node_id
    out: dict[str, np.ndarray] = {}
    for name in names:
        if name == "seq":
            out[name] = np.arange(int(row.first_seq), int(row.first_seq) + n, dtype=np.int64)[mask]
        elif name == "slots":
            out[name] = _slot_blobs(
                widen_array("slot_counts", col("slot_counts")), widen_array("slots", col("slots")), mask
            )
        else:
            out[name] = widen_array(name, col(name)[mask])
    return out


def _slot_blobs(counts: np.ndarray, slots: np.ndarray, mask: np.ndarray) -> np.ndarray:
    ends = np.cumsum(np.maximum(counts, 0))
    starts = ends - np.maximum(counts, 0)
    data = slots.tobytes()
    out = np.empty(int(mask.sum()), dtype=object)
    for i, (start, end, count) in enumerate(zip(starts[mask], ends[mask], counts[mask], strict=True)):
        out[i] = None if count == NO_SLOTS else data[4 * start : 4 * end]
    return out


def _empty(name: str) -> np.ndarray:
    if name == "seq":
        return np.zeros(0, np.int64)
    if name == "slots":
        return np.zeros(0, object)
    return np.zeros(0, COLUMN_DTYPES[name])


def _frame(
    packed: PackedEvents, run_id: int, out: dict[str, np.ndarray], names: list[str], coded: Sequence[str] = ()
) -> pd.DataFrame:
    data: dict[str, Any] = {}
    for name in names:
        values = out[name]
        if name in STRING_COLUMNS:
            data[name] = values.astype(np.int64) if name in coded else packed.strings(run_id, values)
        elif name == "node_id":
            nulls = values == NULL_INT
            # NOTE: as pandas reads a NULL integer column: all NULL is objects, some NULL floats
            data[name] = (
                np.full(len(values), None, object)
                if len(values) and nulls.all()
                else np.where(nulls, np.nan, values)
                if nulls.any()
                else values.astype(np.int64)
            )
        elif values.dtype.kind in "iu":
            data[name] = values.astype(np.int64)
        else:
            data[name] = values
    return pd.DataFrame(data, columns=names)


def _rows(capture: Any, run_id: int, names: list[str], where: EventFilter) -> pd.DataFrame:
    """A run of the row layout (written before version 6), through SQL."""
    e = schema.events.c
    available = {c.name: c for c in schema.columns_as_of(schema.events, capture.schema_version)}
    stmt = select(*(available[name] for name in names)).where(e.run_id == run_id)
    if where.kinds is not None:
        stmt = stmt.where(e.kind.in_(list(where.kinds)))
    if where.step_range is not None:
        stmt = stmt.where(e.step.between(*where.step_range))
    if where.after_seq is not None:
        stmt = stmt.where(e.seq > where.after_seq)
    if where.before_seq is not None:
        stmt = stmt.where(e.seq < where.before_seq)
    if where.rids is not None:
        stmt = stmt.where(e.rid.in_(list(where.rids)))
    if where.node_id is not None:
        stmt = stmt.where(e.node_id == where.node_id)
    if where.seqs is not None:
        stmt = stmt.where(e.seq.in_(list(where.seqs)))
    stmt = stmt.order_by(e.seq)
    if where.limit is not None:
        stmt = stmt.limit(where.limit)
    if where.offset:
        stmt = stmt.offset(where.offset)
    frame = capture.read_frame(stmt)
    for name in names:
        if name in ("seq", "step", "num_tokens", "aux") and frame[name].dtype == object and frame[name].notna().all():
            frame[name] = frame[name].astype(np.int64)
    return frame


def match_principals(capture: Any, run_id: int) -> set[str]:
    """The distinct non-NULL principals of the run's match events (a packed run reads its chunks'
    summaries)."""
    packed: PackedEvents = capture.packed
    if packed.has_chunks(run_id):
        reuse = packed.grouped(run_id, capture.schema_version, "reuse")
        return {str(p) for p, kind, _tokens in reuse if kind == EventKind.MATCH.value and p is not None}
    frame = read_events(capture, run_id, ["principal"], EventFilter.of(kinds=[EventKind.MATCH.value]))
    return {str(v) for v in frame["principal"].dropna().unique()}


def last_seq(capture: Any, run_id: int) -> int:
    """The run's last event seq (-1 when it has none), from either layout."""
    chunks = capture.packed.chunks(run_id)
    if not chunks.empty:
        return int((chunks.first_seq + chunks.num_events).max()) - 1
    e = schema.events.c
    with capture.engine.connect() as conn:
        found = conn.execute(select(func.max(e.seq)).where(e.run_id == run_id)).scalar_one_or_none()
    return -1 if found is None else int(found)
