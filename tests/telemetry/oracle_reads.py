"""Test oracles: the derived reads as they were at commit dd8591d (kvscope/telemetry/derived.py
and sharing.py, with dialect.read_through), copied verbatim. They read the row layout only (SQL
over the `events` table, schema version 5 and older): run them on a v5 capture, never on a
packed one (there they see no events). The reads in kvscope must equal them on the same events
(test_packed_oracles.py).

Also `unpack_to_rows(path)`: the reverse of kvscope.telemetry.upgrade, for tests that run SQL on
`events` against a freshly recorded (packed) capture.
"""

from __future__ import annotations

import bisect
import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import ColumnElement, Engine, Index, Select, Table, TableClause, desc, func, inspect, select, union
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import column

from kvscope.telemetry import schema
from kvscope.telemetry.events import EventKind, PoolName
from kvscope.telemetry.queries import Capture

# -- dialect.py (dd8591d) --------------------------------------------------------------------


class IndexedTable(TableClause):
    """`table`'s columns, read through `index_name` where the dialect takes a hint (SQLite)."""

    # NOTE: the index name changes the SQL, and the inherited cache key does not carry it:
    # statements using this are compiled each time (a handful per dashboard page)
    inherit_cache = False

    def __init__(self, table: Table, index_name: str) -> None:
        super().__init__(table.name, *(column(c.name, c.type) for c in table.columns))
        self.index_name = index_name


@compiles(IndexedTable)
def _plain(element: IndexedTable, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.visit_table(element, **kw)


@compiles(IndexedTable, "sqlite")
def _sqlite_hint(element: IndexedTable, compiler: SQLCompiler, **kw: Any) -> str:
    plain = compiler.visit_table(element, **kw)
    if not kw.get("asfrom"):
        return plain
    return f"{plain} INDEXED BY {compiler.preparer.quote(element.index_name)}"


def read_through(engine: Engine, index: Index) -> TableClause:
    """The index's table read through it, or the plain table where there is nothing to hint:
    another dialect, or an index not built yet (the deferred ones of a run that never closed)."""
    table = index.table
    assert isinstance(table, Table), index
    if engine.dialect.name != "sqlite" or index.name is None:
        return table
    if index.name not in {ix["name"] for ix in inspect(engine).get_indexes(table.name)}:
        return table
    return IndexedTable(table, str(index.name))


# -- derived.py (dd8591d) -------------------------------------------------------------------

EVICTION_LOG_COLUMNS = (
    "seq",
    "step",
    "t_mono",
    "pool",
    "node_id",
    "parent_id",
    "evicted_tokens",
    "reason",
    "age_steps",
    "age_s",
    "idle_steps",
    "idle_s",
    "needed_again_step",
    "needed_again_by",
    "regret_tokens",
)
MAX_PARENT_HOPS = 64  # a chain of splits of splits, followed back to an inserted node
EVICT = EventKind.EVICT.value
ENDS = [EventKind.REQUEST_FINISH.value, EventKind.REQUEST_ABORT.value, EventKind.REQUEST_RETRACT.value]
NODE_TOUCHES = [EventKind.INSERT.value, EventKind.SPLIT.value, EventKind.MATCH.value, EventKind.LOCK.value]
BIRTHS = (EventKind.INSERT, EventKind.SPLIT)


def _events_of_run(source: TableClause, run_id: int, *columns: ColumnElement[Any]) -> Select[Any]:
    return select(*columns).select_from(source).where(source.c.run_id == run_id)


# -- eviction log ----------------------------------------------------------------------------


def eviction_log(capture: Capture, run_id: int, limit: int, offset: int) -> pd.DataFrame:
    """One page of the log (evictions in event order), with age, idle, parent and regret."""
    e = schema.events.c
    ev = capture.read_frame(
        select(e.seq, e.step, e.t_mono, e.pool, e.node_id, e.num_tokens.label("evicted_tokens"), e.reason)
        .where(e.run_id == run_id, e.kind == EVICT)
        .order_by(e.seq)
        .limit(limit)
        .offset(offset)
    )
    if ev.empty:
        return pd.DataFrame(columns=list(EVICTION_LOG_COLUMNS))
    by_node = read_through(capture.engine, schema.ix_events_node)
    nodes = sorted({int(n) for n in ev.node_id})
    history = _NodeHistory(capture, run_id, by_node)
    history.load(nodes)
    parents = [history.parent_at(int(n), int(s)) for n, s in zip(ev.node_id, ev.seq, strict=True)]
    later = _later_matches(
        capture, run_id, by_node, sorted(set(nodes) | {p for p in parents if p is not None}), int(ev.seq.min())
    )
    rows = []
    for row, parent in zip(ev.itertuples(index=False), parents, strict=True):
        born, touch = history.born(row.node_id, row.seq), history.last_touch(row.node_id, row.seq)
        again = min(
            (m for m in (later.first_after(row.node_id, row.seq), later.first_after(parent, row.seq)) if m is not None),
            default=None,
            key=lambda m: m[0],
        )
        rows.append(
            (
                row.seq,
                row.step,
                row.t_mono,
                row.pool,
                row.node_id,
                parent,
                row.evicted_tokens,
                row.reason,
                None if born is None else row.step - born[1],
                None if born is None else row.t_mono - born[2],
                None if touch is None else row.step - touch[1],
                None if touch is None else row.t_mono - touch[2],
                None if again is None else again[1],
                None if again is None else again[2],
                0 if again is None else min(int(row.evicted_tokens), int(again[3])),
            )
        )
    return pd.DataFrame(rows, columns=list(EVICTION_LOG_COLUMNS))


class _NodeHistory:
    """Births, touches and splits of a set of nodes, from one or a few index reads."""

    def __init__(self, capture: Capture, run_id: int, by_node: TableClause) -> None:
        self.capture, self.run_id, self.by_node = capture, run_id, by_node
        self.by_kind = read_through(capture.engine, schema.ix_events_kind)
        self.rows: dict[int, list[tuple[int, int, float, str, int]]] = defaultdict(list)  # (seq, step, t, kind, aux)
        self.splits_of: dict[int, list[tuple[int, int]]] = defaultdict(list)  # node -> [(seq, upper node)]
        self.loaded: set[int] = set()

    def load(self, nodes: Sequence[int]) -> None:
        todo = sorted(set(nodes) - self.loaded)
        if not todo:
            return
        self.loaded.update(todo)
        n = self.by_node.c
        own = self.capture.read_frame(
            _events_of_run(self.by_node, self.run_id, n.seq, n.step, n.t_mono, n.kind, n.node_id, n.aux)
            .where(n.node_id.in_(todo), n.kind.in_(NODE_TOUCHES))
            .order_by(n.seq)
        )
        for r in own.itertuples(index=False):
            self.rows[int(r.node_id)].append((int(r.seq), int(r.step), float(r.t_mono), str(r.kind), int(r.aux)))
        k = self.by_kind.c
        splits = self.capture.read_frame(
            _events_of_run(self.by_kind, self.run_id, k.seq, k.node_id, k.aux)
            .where(k.kind == EventKind.SPLIT.value, k.aux.in_(todo))
            .order_by(k.seq)
        )
        for r in splits.itertuples(index=False):
            self.splits_of[int(r.aux)].append((int(r.seq), int(r.node_id)))

    def born(self, node: int, before: int) -> tuple[int, int, float, str, int] | None:
        return next((r for r in self.rows[node] if r[3] in BIRTHS and r[0] < before), None)

    def last_touch(self, node: int, before: int) -> tuple[int, int, float, str, int] | None:
        rows = self.rows[node]
        index = bisect.bisect_left(rows, before, key=lambda r: r[0])
        return rows[index - 1] if index else None

    def parent_at(self, node: int, seq: int) -> int | None:
        for _ in range(MAX_PARENT_HOPS):
            self.load([node])
            splits = self.splits_of[node]
            index = bisect.bisect_left(splits, seq, key=lambda s: s[0])
            if index:
                return splits[index - 1][1]  # its latest split's upper piece
            born = self.born(node, seq)
            if born is None:
                return None
            if born[3] == EventKind.INSERT:
                return born[4]
            node, seq = born[4], born[0]  # an upper piece: the parent the split node had then
        return None


class _LaterMatches:
    def __init__(self, frame_: pd.DataFrame) -> None:
        self.by_node: dict[int, list[tuple[int, int, str, int]]] = defaultdict(list)  # (seq, step, rid, miss)
        for r in frame_.itertuples(index=False):
            self.by_node[int(r.node_id)].append((int(r.seq), int(r.step), r.rid, int(r.aux)))

    def first_after(self, node: int | None, seq: int) -> tuple[int, int, str, int] | None:
        if node is None:
            return None
        matches = self.by_node.get(node, [])
        index = bisect.bisect_right(matches, seq, key=lambda m: m[0])
        return matches[index] if index < len(matches) else None


def _later_matches(
    capture: Capture, run_id: int, by_node: TableClause, nodes: list[int], after_seq: int
) -> _LaterMatches:
    """Matches that stopped at one of `nodes` after `after_seq` and missed tokens."""
    n = by_node.c
    return _LaterMatches(
        capture.read_frame(
            _events_of_run(by_node, run_id, n.seq, n.step, n.rid, n.node_id, n.aux)
            .where(n.node_id.in_(nodes), n.kind == EventKind.MATCH.value, n.aux > 0, n.seq > after_seq)
            .order_by(n.seq)
        )
    )


# -- running requests ------------------------------------------------------------------------


def running_lengths(capture: Capture, run_id: int, step: int) -> pd.DataFrame:
    """rid, seq_len of every request running at `step`: matched by then and not finished,
    aborted or retracted since its latest match."""
    by_kind = read_through(capture.engine, schema.ix_events_kind)
    k = by_kind.c
    latest = capture.read_frame(
        _events_of_run(by_kind, run_id, k.rid, func.max(k.seq).label("mseq"))
        .where(k.kind == EventKind.MATCH.value, k.step <= step, k.rid.is_not(None))
        .group_by(k.rid)
    )
    ends = capture.read_frame(
        _events_of_run(by_kind, run_id, k.rid, func.max(k.seq).label("eseq"))
        .where(k.kind.in_(ENDS), k.step <= step, k.rid.is_not(None))
        .group_by(k.rid)
    )
    live = latest.merge(ends, on="rid", how="left")
    live = live[live.eseq.isna() | (live.eseq < live.mseq)]
    if live.empty:
        return pd.DataFrame({"rid": pd.Series(dtype=object), "seq_len": pd.Series(dtype="int64")})
    e = schema.events.c
    hits = capture.read_frame(
        select(e.seq.label("mseq"), e.step.label("mstep"), e.num_tokens.label("hit")).where(
            e.run_id == run_id, e.seq.in_([int(s) for s in live.mseq])
        )
    )
    live = live.merge(hits, on="mseq")
    allocs = capture.read_frame(
        _events_of_run(by_kind, run_id, k.rid, k.seq, k.num_tokens).where(
            k.kind == EventKind.ALLOC.value,
            k.step.between(int(live.mstep.min()), step),
            k.pool == PoolName.FULL.value,
            k.rid.in_(list(live.rid)),
        )
    )
    since = allocs.merge(live[["rid", "mseq"]], on="rid")
    grown = since[since.seq > since.mseq].groupby("rid")["num_tokens"].sum()
    live["seq_len"] = live["hit"] + live["rid"].map(grown).fillna(0).astype("int64")
    return live[["rid", "seq_len"]].reset_index(drop=True)


def allocs_of_requests(capture: Capture, run_id: int, rids: Sequence[str]) -> pd.DataFrame:
    """rid, step, tokens: each request's full-pool allocations per step."""
    if not rids:
        return pd.DataFrame(columns=["rid", "step", "tokens"])
    by_rid = read_through(capture.engine, schema.ix_events_rid)
    r = by_rid.c
    return capture.read_frame(
        _events_of_run(by_rid, run_id, r.rid, r.step, func.sum(r.num_tokens).label("tokens"))
        .where(r.rid.in_(list(rids)), r.kind == EventKind.ALLOC.value, r.pool == PoolName.FULL.value)
        .group_by(r.rid, r.step)
        .order_by(r.rid, r.step)
    )


# -- evictions over time ---------------------------------------------------------------------


def eviction_summary(capture: Capture, run_id: int) -> pd.DataFrame:
    e = schema.events.c
    return capture.read_frame(
        select(
            func.coalesce(e.reason, "?").label("reason"),
            e.pool,
            func.count().label("num_evictions"),
            func.sum(e.num_tokens).label("evicted_tokens"),
            func.min(e.step).label("first_step"),
            func.max(e.step).label("last_step"),
        )
        .where(e.run_id == run_id, e.kind == EVICT)
        .group_by(e.reason, e.pool)
        .order_by(desc("num_evictions"))
    )


def evictions_over_steps(capture: Capture, run_id: int, max_points: int) -> pd.DataFrame:
    """Evictions and evicted tokens per bucket of steps (at most `max_points` buckets; `step` is
    each bucket's last step with an eviction, `steps` its width)."""
    by_kind = read_through(capture.engine, schema.ix_events_kind)
    k = by_kind.c
    bounds = capture.read_frame(
        _events_of_run(by_kind, run_id, func.min(k.step).label("lo"), func.max(k.step).label("hi")).where(
            k.kind == EVICT
        )
    ).iloc[0]
    if pd.isna(bounds.lo):
        return pd.DataFrame(columns=["step", "num_evictions", "evicted_tokens", "t_mono", "steps"])
    lo = int(bounds.lo)
    width = max(1, -(-(int(bounds.hi) - lo + 1) // max_points))
    e = schema.events.c
    out = capture.read_frame(
        select(
            func.max(e.step).label("step"),
            func.count().label("num_evictions"),
            func.sum(e.num_tokens).label("evicted_tokens"),
            func.min(e.t_mono).label("t_mono"),
        )
        .where(e.run_id == run_id, e.kind == EVICT)
        .group_by((e.step - lo) // width)
        .order_by(func.max(e.step))
    )
    out["steps"] = width
    return out


def recent_evictions(capture: Capture, run_id: int, since_step: int) -> pd.DataFrame:
    e = schema.events.c
    return capture.read_frame(
        select(
            func.count().label("num_evictions"), func.coalesce(func.sum(e.num_tokens), 0).label("evicted_tokens")
        ).where(e.run_id == run_id, e.kind == EVICT, e.step >= since_step)
    )


# -- usage -----------------------------------------------------------------------------------


def usage_at(capture: Capture, run_id: int, step: int) -> pd.DataFrame:
    """The usage row of the last sampled step at or before `step`, exact (not downsampled);
    empty when there is none."""
    u = schema.usage.c
    columns = schema.columns_as_of(schema.usage, capture.schema_version)
    return capture.read_frame(
        select(*columns).where(u.run_id == run_id, u.step <= step).order_by(desc(u.step)).limit(1)
    )


# -- sharing.py (dd8591d) -------------------------------------------------------------------

VISIBILITY_KINDS = (EventKind.PROMOTE.value, EventKind.DEMOTE.value)
REUSE_KINDS = (EventKind.MATCH.value, EventKind.CROSS_HIT.value)
REUSE_COLUMNS = ("principal", "matched_tokens", "cross_tokens")


def run_principals(capture: Capture, run_id: int) -> list[str]:
    """The distinct principals of the run's requests and match events, sorted."""
    r, e = schema.requests.c, schema.events.c
    of_requests = select(r.principal).where(r.run_id == run_id, r.principal.is_not(None)).distinct()
    if capture.schema_version < schema.since_version(e.principal):
        return sorted(str(p) for p in capture.read_frame(of_requests).iloc[:, 0])
    of_matches = select(e.principal).where(
        e.run_id == run_id, e.kind == EventKind.MATCH.value, e.principal.is_not(None)
    )
    return sorted(str(p) for p in capture.read_frame(union(of_requests, of_matches)).iloc[:, 0])


def visibility_changes(capture: Capture, run_id: int) -> pd.DataFrame:
    """Promotions and demotions per step: step, kind, num_events, num_tokens."""
    e = schema.events.c
    stmt = (
        select(e.step, e.kind, func.count().label("num_events"), func.sum(e.num_tokens).label("num_tokens"))
        .where(e.run_id == run_id, e.kind.in_(VISIBILITY_KINDS))
        .group_by(e.step, e.kind)
        .order_by(e.step)
    )
    return capture.read_frame(stmt)


def reuse_by_principal(capture: Capture, run_id: int) -> pd.DataFrame:
    """Per requesting principal (None: not recorded): tokens its matches reused and the part of
    them in nodes another principal owns. Empty before schema version 3."""
    if capture.schema_version < 3:
        return pd.DataFrame(columns=list(REUSE_COLUMNS))
    e = schema.events.c
    stmt = (
        select(e.principal, e.kind, func.sum(e.num_tokens).label("num_tokens"))
        .where(e.run_id == run_id, e.kind.in_(REUSE_KINDS))
        .group_by(e.principal, e.kind)
    )
    sums = capture.read_frame(stmt)
    if sums.empty:
        return pd.DataFrame(columns=list(REUSE_COLUMNS))
    table = sums.pivot_table(
        index="principal", columns="kind", values="num_tokens", aggfunc="sum", fill_value=0, dropna=False
    )
    table = table.reindex(columns=list(REUSE_KINDS), fill_value=0).astype(int).rename_axis(columns=None).reset_index()
    return table.rename(columns={"match": "matched_tokens", "cross_hit": "cross_tokens"})[list(REUSE_COLUMNS)]


# -- the reverse of upgrade ------------------------------------------------------------------


def unpack_to_rows(path: str | Path) -> int:
    """Write every packed event of the file back as one `events` row (same seq, step, time and
    fields), build the events indexes a closed run of the row layout has, and delete the chunks:
    the file then reads as runs written before schema version 6. Returns the events written."""
    capture = Capture(path)
    try:
        frames = {
            int(run_id): capture.events(int(run_id), limit=None)
            for run_id in capture.runs().id
            if not capture.packed.chunks(int(run_id)).empty
        }
    finally:
        capture.close()
    names = ["run_id", *schema.EVENT_COLUMNS[1:]]
    with sqlite3.connect(path) as conn:
        for run_id, frame in frames.items():
            rows = [(run_id, *(_plain(v) for v in row)) for row in frame[list(names[1:])].itertuples(index=False)]
            conn.executemany(f"INSERT INTO events ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})", rows)
            for table in schema.PACKED_TABLES:
                conn.execute(f"DELETE FROM {table.name} WHERE run_id = ?", (run_id,))
        for index in (*schema.events.indexes, *schema.DEFERRED_INDEXES):
            columns = ", ".join(str(c.name) for c in index.columns)
            conn.execute(f"CREATE INDEX IF NOT EXISTS {index.name} ON events ({columns})")
    conn.close()
    return sum(len(f) for f in frames.values())


def _plain(value: Any) -> Any:
    """A DataFrame cell as SQLite takes it: NaN and None are NULL, numpy scalars plain Python."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    return value.item() if isinstance(value, np.generic) else value
