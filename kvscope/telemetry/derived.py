"""Derived reads over a capture's events, for the dashboard: the eviction log (age, idle,
regret), running requests' lengths at a step, eviction rates. Each returns a DataFrame.

NOTE: definitions (also shown on the pages)
    node age       eviction step/time minus the step/time the node was born (its insert, or the
                   split that created it)
    idle           eviction time minus the node's last touch: the latest match or lock that ended
                   at this very node, or its birth. A match ending deeper also touches it, so
                   idle is an upper bound.
    parent         the node's parent at eviction time: the upper piece of its latest split, else
                   the parent it was inserted under; a node born as a split's upper piece takes
                   the parent the split node had then
    regret         an eviction is 'needed again' when a later match stopped at the evicted node
                   (partly evicted) or at its parent at eviction time, and then missed tokens;
                   regret tokens = min(evicted tokens, that first match's miss). A request that
                   branched off at the same parent for other reasons counts too: an upper bound.
    running length a running request's tokens at a step: the hit of its latest match by then plus
                   the full-pool tokens allocated for it since

NOTE: cost. Every query here is a handful of index range reads whose size is bounded by the
page shown (200 evictions and their nodes) or by the number of requests, never one lookup per
row over the whole event table: the correlated-subquery version of the eviction log took ~20 s
per page on a million-event capture, because a hot parent node's later matches were scanned
once per eviction. A run that was killed has no rid/node index (built at close), so the node
lookups scan its events once per page instead. The index each read goes through is named with
dialect.read_through: a hint on SQLite, nothing on a server database.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pandas as pd
from sqlalchemy import ColumnElement, Select, TableClause, desc, func, select

from kvscope.telemetry import schema
from kvscope.telemetry.dialect import read_through
from kvscope.telemetry.events import EventKind, PoolName
from kvscope.telemetry.queries import Capture

EVICTION_LOG_COLUMNS = ("seq", "step", "t_mono", "pool", "node_id", "parent_id", "evicted_tokens", "reason",
                        "age_steps", "age_s", "idle_steps", "idle_s", "needed_again_step", "needed_again_by",
                        "regret_tokens")
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
        .where(e.run_id == run_id, e.kind == EVICT).order_by(e.seq).limit(limit).offset(offset))
    if ev.empty:
        return pd.DataFrame(columns=list(EVICTION_LOG_COLUMNS))
    by_node = read_through(capture.engine, schema.ix_events_node)
    nodes = sorted({int(n) for n in ev.node_id})
    history = _NodeHistory(capture, run_id, by_node)
    history.load(nodes)
    parents = [history.parent_at(int(n), int(s)) for n, s in zip(ev.node_id, ev.seq, strict=True)]
    later = _later_matches(capture, run_id, by_node, sorted(set(nodes) | {p for p in parents if p is not None}),
                           int(ev.seq.min()))
    rows = []
    for row, parent in zip(ev.itertuples(index=False), parents, strict=True):
        born, touch = history.born(row.node_id, row.seq), history.last_touch(row.node_id, row.seq)
        again = min((m for m in (later.first_after(row.node_id, row.seq), later.first_after(parent, row.seq))
                     if m is not None), default=None, key=lambda m: m[0])
        rows.append((
            row.seq, row.step, row.t_mono, row.pool, row.node_id, parent, row.evicted_tokens, row.reason,
            None if born is None else row.step - born[1], None if born is None else row.t_mono - born[2],
            None if touch is None else row.step - touch[1], None if touch is None else row.t_mono - touch[2],
            None if again is None else again[1], None if again is None else again[2],
            0 if again is None else min(int(row.evicted_tokens), int(again[3])),
        ))
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
            .where(n.node_id.in_(todo), n.kind.in_(NODE_TOUCHES)).order_by(n.seq))
        for r in own.itertuples(index=False):
            self.rows[int(r.node_id)].append((int(r.seq), int(r.step), float(r.t_mono), str(r.kind), int(r.aux)))
        k = self.by_kind.c
        splits = self.capture.read_frame(
            _events_of_run(self.by_kind, self.run_id, k.seq, k.node_id, k.aux)
            .where(k.kind == EventKind.SPLIT.value, k.aux.in_(todo)).order_by(k.seq))
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


def _later_matches(capture: Capture, run_id: int, by_node: TableClause, nodes: list[int],
                   after_seq: int) -> _LaterMatches:
    """Matches that stopped at one of `nodes` after `after_seq` and missed tokens."""
    n = by_node.c
    return _LaterMatches(capture.read_frame(
        _events_of_run(by_node, run_id, n.seq, n.step, n.rid, n.node_id, n.aux)
        .where(n.node_id.in_(nodes), n.kind == EventKind.MATCH.value, n.aux > 0, n.seq > after_seq)
        .order_by(n.seq)))


# -- running requests ------------------------------------------------------------------------

def running_lengths(capture: Capture, run_id: int, step: int) -> pd.DataFrame:
    """rid, seq_len of every request running at `step`: matched by then and not finished,
    aborted or retracted since its latest match."""
    by_kind = read_through(capture.engine, schema.ix_events_kind)
    k = by_kind.c
    latest = capture.read_frame(
        _events_of_run(by_kind, run_id, k.rid, func.max(k.seq).label("mseq"))
        .where(k.kind == EventKind.MATCH.value, k.step <= step, k.rid.is_not(None)).group_by(k.rid))
    ends = capture.read_frame(
        _events_of_run(by_kind, run_id, k.rid, func.max(k.seq).label("eseq"))
        .where(k.kind.in_(ENDS), k.step <= step, k.rid.is_not(None)).group_by(k.rid))
    live = latest.merge(ends, on="rid", how="left")
    live = live[live.eseq.isna() | (live.eseq < live.mseq)]
    if live.empty:
        return pd.DataFrame({"rid": pd.Series(dtype=object), "seq_len": pd.Series(dtype="int64")})
    e = schema.events.c
    hits = capture.read_frame(
        select(e.seq.label("mseq"), e.step.label("mstep"), e.num_tokens.label("hit"))
        .where(e.run_id == run_id, e.seq.in_([int(s) for s in live.mseq])))
    live = live.merge(hits, on="mseq")
    allocs = capture.read_frame(
        _events_of_run(by_kind, run_id, k.rid, k.seq, k.num_tokens)
        .where(k.kind == EventKind.ALLOC.value, k.step.between(int(live.mstep.min()), step),
               k.pool == PoolName.FULL.value, k.rid.in_(list(live.rid))))
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
        .group_by(r.rid, r.step).order_by(r.rid, r.step))


# -- evictions over time ---------------------------------------------------------------------

def eviction_summary(capture: Capture, run_id: int) -> pd.DataFrame:
    e = schema.events.c
    return capture.read_frame(
        select(func.coalesce(e.reason, "?").label("reason"), e.pool, func.count().label("num_evictions"),
               func.sum(e.num_tokens).label("evicted_tokens"), func.min(e.step).label("first_step"),
               func.max(e.step).label("last_step"))
        .where(e.run_id == run_id, e.kind == EVICT).group_by(e.reason, e.pool).order_by(desc("num_evictions")))


def evictions_over_steps(capture: Capture, run_id: int, max_points: int) -> pd.DataFrame:
    """Evictions and evicted tokens per bucket of steps (at most `max_points` buckets; `step` is
    each bucket's last step with an eviction, `steps` its width)."""
    by_kind = read_through(capture.engine, schema.ix_events_kind)
    k = by_kind.c
    bounds = capture.read_frame(
        _events_of_run(by_kind, run_id, func.min(k.step).label("lo"), func.max(k.step).label("hi"))
        .where(k.kind == EVICT)).iloc[0]
    if pd.isna(bounds.lo):
        return pd.DataFrame(columns=["step", "num_evictions", "evicted_tokens", "t_mono", "steps"])
    lo = int(bounds.lo)
    width = max(1, -(-(int(bounds.hi) - lo + 1) // max_points))
    e = schema.events.c
    out = capture.read_frame(
        select(func.max(e.step).label("step"), func.count().label("num_evictions"),
               func.sum(e.num_tokens).label("evicted_tokens"), func.min(e.t_mono).label("t_mono"))
        .where(e.run_id == run_id, e.kind == EVICT).group_by((e.step - lo) // width).order_by(func.max(e.step)))
    out["steps"] = width
    return out


def recent_evictions(capture: Capture, run_id: int, since_step: int) -> pd.DataFrame:
    e = schema.events.c
    return capture.read_frame(
        select(func.count().label("num_evictions"), func.coalesce(func.sum(e.num_tokens), 0).label("evicted_tokens"))
        .where(e.run_id == run_id, e.kind == EVICT, e.step >= since_step))


# -- usage -----------------------------------------------------------------------------------

def usage_at(capture: Capture, run_id: int, step: int) -> pd.DataFrame:
    """The usage row of the last sampled step at or before `step`, exact (not downsampled);
    empty when there is none."""
    u = schema.usage.c
    columns = schema.columns_as_of(schema.usage, capture.schema_version)
    return capture.read_frame(select(*columns).where(u.run_id == run_id, u.step <= step)
                              .order_by(desc(u.step)).limit(1))
