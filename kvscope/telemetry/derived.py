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
lookups scan its events once per page instead.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pandas as pd
from sqlalchemy import Engine, bindparam, text

from kvscope.telemetry.queries import Capture

EVICTION_LOG_COLUMNS = ("seq", "step", "t_mono", "pool", "node_id", "parent_id", "evicted_tokens", "reason",
                        "age_steps", "age_s", "idle_steps", "idle_s", "needed_again_step", "needed_again_by",
                        "regret_tokens")
MAX_PARENT_HOPS = 64  # a chain of splits of splits, followed back to an inserted node


def frame(engine: Engine, sql: str, **params: Any) -> pd.DataFrame:
    """A SQL text query to a DataFrame; list and tuple parameters expand (`IN :name`)."""
    stmt = text(sql)
    for name, value in params.items():
        if isinstance(value, tuple | list):
            stmt = stmt.bindparams(bindparam(name, expanding=True))
    with engine.connect() as conn:
        result = conn.execute(stmt, params)
        return pd.DataFrame([tuple(row) for row in result.fetchall()], columns=list(result.keys()))


def _has_index(engine: Engine, name: str) -> bool:
    with engine.connect() as conn:
        return conn.execute(text("SELECT 1 FROM sqlite_master WHERE name = :n"), {"n": name}).first() is not None


# -- eviction log ----------------------------------------------------------------------------

def eviction_log(capture: Capture, run_id: int, limit: int, offset: int) -> pd.DataFrame:
    """One page of the log (evictions in event order), with age, idle, parent and regret."""
    engine = capture.engine
    ev = frame(engine, "SELECT seq, step, t_mono, pool, node_id, num_tokens AS evicted_tokens, reason FROM events "
               "WHERE run_id = :run AND kind = 'evict' ORDER BY seq LIMIT :limit OFFSET :offset",
               run=run_id, limit=limit, offset=offset)
    if ev.empty:
        return pd.DataFrame(columns=list(EVICTION_LOG_COLUMNS))
    by_node = "INDEXED BY ix_events_node" if _has_index(engine, "ix_events_node") else ""
    nodes = sorted({int(n) for n in ev.node_id})
    history = _NodeHistory(engine, run_id, by_node)
    history.load(nodes)
    parents = [history.parent_at(int(n), int(s)) for n, s in zip(ev.node_id, ev.seq, strict=True)]
    later = _later_matches(engine, run_id, by_node, sorted(set(nodes) | {p for p in parents if p is not None}),
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

    def __init__(self, engine: Engine, run_id: int, by_node: str) -> None:
        self.engine, self.run_id, self.by_node = engine, run_id, by_node
        self.rows: dict[int, list[tuple[int, int, float, str, int]]] = defaultdict(list)  # (seq, step, t, kind, aux)
        self.splits_of: dict[int, list[tuple[int, int]]] = defaultdict(list)  # node -> [(seq, upper node)]
        self.loaded: set[int] = set()

    def load(self, nodes: Sequence[int]) -> None:
        todo = sorted(set(nodes) - self.loaded)
        if not todo:
            return
        self.loaded.update(todo)
        own = frame(self.engine, f"SELECT seq, step, t_mono, kind, node_id, aux FROM events {self.by_node} "
                    "WHERE run_id = :run AND node_id IN :nodes AND kind IN ('insert', 'split', 'match', 'lock') "
                    "ORDER BY seq", run=self.run_id, nodes=todo)
        for r in own.itertuples(index=False):
            self.rows[int(r.node_id)].append((int(r.seq), int(r.step), float(r.t_mono), str(r.kind), int(r.aux)))
        splits = frame(self.engine, "SELECT seq, node_id, aux FROM events INDEXED BY ix_events_kind "
                       "WHERE run_id = :run AND kind = 'split' AND aux IN :nodes ORDER BY seq",
                       run=self.run_id, nodes=todo)
        for r in splits.itertuples(index=False):
            self.splits_of[int(r.aux)].append((int(r.seq), int(r.node_id)))

    def born(self, node: int, before: int) -> tuple[int, int, float, str, int] | None:
        return next((r for r in self.rows[node] if r[3] in ("insert", "split") and r[0] < before), None)

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
            if born[3] == "insert":
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


def _later_matches(engine: Engine, run_id: int, by_node: str, nodes: list[int], after_seq: int) -> _LaterMatches:
    """Matches that stopped at one of `nodes` after `after_seq` and missed tokens."""
    return _LaterMatches(frame(engine, f"SELECT seq, step, rid, node_id, aux FROM events {by_node} "
                               "WHERE run_id = :run AND node_id IN :nodes AND kind = 'match' AND aux > 0 "
                               "AND seq > :after ORDER BY seq", run=run_id, nodes=nodes, after=after_seq))


# -- running requests ------------------------------------------------------------------------

def running_lengths(capture: Capture, run_id: int, step: int) -> pd.DataFrame:
    """rid, seq_len of every request running at `step`: matched by then and not finished,
    aborted or retracted since its latest match."""
    engine = capture.engine
    latest = frame(engine, "SELECT rid, max(seq) AS mseq FROM events INDEXED BY ix_events_kind WHERE run_id = :run "
                   "AND kind = 'match' AND step <= :step AND rid IS NOT NULL GROUP BY rid", run=run_id, step=step)
    ends = frame(engine, "SELECT rid, max(seq) AS eseq FROM events INDEXED BY ix_events_kind WHERE run_id = :run "
                 "AND kind IN ('finish', 'abort', 'retract') AND step <= :step AND rid IS NOT NULL GROUP BY rid",
                 run=run_id, step=step)
    live = latest.merge(ends, on="rid", how="left")
    live = live[live.eseq.isna() | (live.eseq < live.mseq)]
    if live.empty:
        return pd.DataFrame({"rid": pd.Series(dtype=object), "seq_len": pd.Series(dtype="int64")})
    hits = frame(engine, "SELECT seq AS mseq, step AS mstep, num_tokens AS hit FROM events WHERE run_id = :run "
                 "AND seq IN :seqs", run=run_id, seqs=[int(s) for s in live.mseq])
    live = live.merge(hits, on="mseq")
    allocs = frame(engine, "SELECT rid, seq, num_tokens FROM events INDEXED BY ix_events_kind WHERE run_id = :run "
                   "AND kind = 'alloc' AND step BETWEEN :lo AND :step AND pool = 'full' AND rid IN :rids",
                   run=run_id, lo=int(live.mstep.min()), step=step, rids=list(live.rid))
    since = allocs.merge(live[["rid", "mseq"]], on="rid")
    grown = since[since.seq > since.mseq].groupby("rid")["num_tokens"].sum()
    live["seq_len"] = live["hit"] + live["rid"].map(grown).fillna(0).astype("int64")
    return live[["rid", "seq_len"]].reset_index(drop=True)


def allocs_of_requests(capture: Capture, run_id: int, rids: Sequence[str]) -> pd.DataFrame:
    """rid, step, tokens: each request's full-pool allocations per step."""
    if not rids:
        return pd.DataFrame(columns=["rid", "step", "tokens"])
    by_rid = "INDEXED BY ix_events_rid" if _has_index(capture.engine, "ix_events_rid") else ""
    return frame(capture.engine, f"SELECT rid, step, sum(num_tokens) AS tokens FROM events {by_rid} "
                 "WHERE run_id = :run AND rid IN :rids AND kind = 'alloc' AND pool = 'full' "
                 "GROUP BY rid, step ORDER BY rid, step", run=run_id, rids=list(rids))


# -- evictions over time ---------------------------------------------------------------------

def eviction_summary(capture: Capture, run_id: int) -> pd.DataFrame:
    return frame(capture.engine, """
        SELECT coalesce(reason, '?') AS reason, pool, count(*) AS num_evictions, sum(num_tokens) AS evicted_tokens,
            min(step) AS first_step, max(step) AS last_step
        FROM events WHERE run_id = :run AND kind = 'evict' GROUP BY reason, pool ORDER BY num_evictions DESC""",
                 run=run_id)


def evictions_over_steps(capture: Capture, run_id: int, max_points: int) -> pd.DataFrame:
    """Evictions and evicted tokens per bucket of steps (at most `max_points` buckets; `step` is
    each bucket's last step with an eviction, `steps` its width)."""
    bounds = frame(capture.engine, "SELECT min(step) AS lo, max(step) AS hi FROM events INDEXED BY ix_events_kind "
                   "WHERE run_id = :run AND kind = 'evict'", run=run_id).iloc[0]
    if pd.isna(bounds.lo):
        return pd.DataFrame(columns=["step", "num_evictions", "evicted_tokens", "t_mono", "steps"])
    width = max(1, -(-(int(bounds.hi) - int(bounds.lo) + 1) // max_points))
    out = frame(capture.engine, """
        SELECT max(step) AS step, count(*) AS num_evictions, sum(num_tokens) AS evicted_tokens, min(t_mono) AS t_mono
        FROM events WHERE run_id = :run AND kind = 'evict' GROUP BY (step - :lo) / :width ORDER BY 1""",
                run=run_id, lo=int(bounds.lo), width=width)
    out["steps"] = width
    return out


def recent_evictions(capture: Capture, run_id: int, since_step: int) -> pd.DataFrame:
    return frame(capture.engine, "SELECT count(*) AS num_evictions, coalesce(sum(num_tokens), 0) AS evicted_tokens "
                 "FROM events WHERE run_id = :run AND kind = 'evict' AND step >= :since", run=run_id,
                 since=since_step)
