"""Aggregates the dashboard needs beyond `telemetry.queries`, done in SQL on the read-only engine.

NOTE: definitions (also shown on the pages)
    node age       eviction step/time minus the step/time the node was born (its insert, or the
                   split that created it)
    idle           eviction time minus the node's last touch: the latest match or lock that ended
                   at this very node, or its birth. A match ending deeper also touches it, so
                   idle is an upper bound.
    regret         an eviction is 'needed again' when a later match stopped at the evicted node
                   (partly evicted) or at its parent at eviction time, and then missed tokens;
                   regret tokens = min(evicted tokens, that first match's miss). A request that
                   branched off at the same parent for other reasons counts too: an upper bound.
    page waste     a running request holds ceil(len / page_size) pages; the unused tail slots of
                   its last page are wasted. len = the hit of its latest match + the tokens
                   allocated for it since.

NOTE: `+x.seq` in the correlated subqueries keeps SQLite off the (run_id, seq) primary key for
those range tests, so it looks events up by node or rid (ix_events_node / ix_events_rid):
without it a page of 200 evictions scanned the events table once per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
from sqlalchemy import Engine, bindparam, text

EVICTION_LOG = """
WITH ev AS (
    SELECT seq, step, t_mono, pool, node_id, num_tokens, reason FROM events
    WHERE run_id = :run AND kind = 'evict' ORDER BY seq LIMIT :limit OFFSET :offset
), born AS MATERIALIZED (
    SELECT ev.seq,
        (SELECT min(b.seq) FROM events b {by_node} WHERE b.run_id = :run AND b.node_id = ev.node_id
            AND b.kind IN ('insert', 'split') AND +b.seq < ev.seq) AS born_seq,
        (SELECT max(t.seq) FROM events t {by_node} WHERE t.run_id = :run AND t.node_id = ev.node_id
            AND t.kind IN ('match', 'lock', 'insert', 'split') AND +t.seq < ev.seq) AS touch_seq,
        (SELECT max(s.seq) FROM events s INDEXED BY ix_events_kind WHERE s.run_id = :run AND s.kind = 'split'
            AND s.aux = ev.node_id
            AND +s.seq < ev.seq) AS split_seq
    FROM ev
), kin AS MATERIALIZED (
    SELECT born.*, coalesce(
        (SELECT s.node_id FROM events s WHERE s.run_id = :run AND s.seq = born.split_seq),
        (SELECT i.aux FROM events i WHERE i.run_id = :run AND i.seq = born.born_seq AND i.kind = 'insert'),
        (SELECT p.node_id FROM events p WHERE p.run_id = :run AND p.seq = born.born_seq AND p.kind = 'split')
    ) AS parent_id FROM born
), again AS (
    SELECT kin.*, (SELECT min(m.seq) FROM events m WHERE m.run_id = :run AND m.kind = 'match'
        AND m.node_id IN (ev.node_id, kin.parent_id) AND m.aux > 0 AND +m.seq > ev.seq) AS again_seq
    FROM kin JOIN ev ON ev.seq = kin.seq
)
SELECT ev.seq, ev.step, ev.t_mono, ev.pool, ev.node_id, again.parent_id, ev.num_tokens AS evicted_tokens, ev.reason,
    ev.step - b.step AS age_steps, ev.t_mono - b.t_mono AS age_s,
    ev.step - t.step AS idle_steps, ev.t_mono - t.t_mono AS idle_s,
    m.step AS needed_again_step, m.rid AS needed_again_by,
    CASE WHEN m.seq IS NULL THEN 0 ELSE min(ev.num_tokens, m.aux) END AS regret_tokens
FROM ev JOIN again ON again.seq = ev.seq
LEFT JOIN events b ON b.run_id = :run AND b.seq = again.born_seq
LEFT JOIN events t ON t.run_id = :run AND t.seq = again.touch_seq
LEFT JOIN events m ON m.run_id = :run AND m.seq = again.again_seq
ORDER BY ev.seq
"""

EVICTION_SUMMARY = """
SELECT coalesce(reason, '?') AS reason, pool, count(*) AS num_evictions, sum(num_tokens) AS evicted_tokens,
    min(step) AS first_step, max(step) AS last_step
FROM events WHERE run_id = :run AND kind = 'evict' GROUP BY reason, pool ORDER BY num_evictions DESC
"""

EVICTIONS_PER_STEP = """
SELECT step, count(*) AS num_evictions, sum(num_tokens) AS evicted_tokens, min(t_mono) AS t_mono
FROM events WHERE run_id = :run AND kind = 'evict' GROUP BY step ORDER BY step
"""

RECENT_RATE = """
SELECT count(*) AS num_evictions, coalesce(sum(num_tokens), 0) AS evicted_tokens
FROM events WHERE run_id = :run AND kind = 'evict' AND step >= :since_step
"""

ALLOCS_OF_REQUESTS = """
SELECT rid, step, sum(num_tokens) AS tokens FROM events
WHERE run_id = :run AND kind = 'alloc' AND pool = 'full' AND rid IN :rids GROUP BY rid, step ORDER BY rid, step
"""

RUNNING_LENGTHS = """
WITH m AS (
    SELECT rid, max(seq) AS mseq FROM events
    WHERE run_id = :run AND kind = 'match' AND step <= :step AND rid IS NOT NULL GROUP BY rid
), live AS (
    SELECT m.rid, m.mseq FROM m WHERE NOT EXISTS (
        SELECT 1 FROM events x WHERE x.run_id = :run AND x.rid = m.rid AND x.kind IN ('finish', 'abort', 'retract')
        AND +x.seq > m.mseq AND x.step <= :step)
)
SELECT live.rid,
    (SELECT h.num_tokens FROM events h WHERE h.run_id = :run AND h.seq = live.mseq)
    + coalesce((SELECT sum(a.num_tokens) FROM events a WHERE a.run_id = :run AND a.rid = live.rid
        AND a.kind = 'alloc' AND a.pool = 'full' AND +a.seq > live.mseq AND a.step <= :step), 0) AS seq_len
FROM live
"""


def frame(engine: Engine, sql: str, **params: Any) -> pd.DataFrame:
    stmt = text(sql)
    for name, value in params.items():
        if isinstance(value, tuple | list):
            stmt = stmt.bindparams(bindparam(name, expanding=True))
    with engine.connect() as conn:
        result = conn.execute(stmt, params)
        return pd.DataFrame(result.fetchall(), columns=list(result.keys()))


def eviction_log(engine: Engine, run_id: int, limit: int, offset: int) -> pd.DataFrame:
    """One page of the log. A closed run has ix_events_node (built at close) and the lookups
    use it; a running or killed run has not, and each row scans the run's events."""
    with engine.connect() as conn:
        has_index = conn.execute(text("SELECT 1 FROM sqlite_master WHERE name = 'ix_events_node'")).first()
    by_node = "INDEXED BY ix_events_node" if has_index else ""
    return frame(engine, EVICTION_LOG.replace("{by_node}", by_node), run=run_id, limit=limit, offset=offset)


def allocs_of_requests(engine: Engine, run_id: int, rids: Sequence[str]) -> pd.DataFrame:
    if not rids:
        return pd.DataFrame(columns=["rid", "step", "tokens"])
    return frame(engine, ALLOCS_OF_REQUESTS, run=run_id, rids=list(rids))


def page_waste(lengths: pd.DataFrame, page_size: int) -> pd.DataFrame:
    """Per running request: tokens, slots held (whole pages) and wasted tail slots."""
    out = lengths.copy()
    out["seq_len"] = out["seq_len"].fillna(0).astype(int)
    out["slots_held"] = -(-out["seq_len"] // page_size) * page_size
    out["wasted_slots"] = out["slots_held"] - out["seq_len"]
    return out
