"""The first, correlated-subquery versions of the eviction log and running lengths: slow on a
big capture (one scan per row), but a direct transcription of the definitions in
kvscope/telemetry/derived.py, so they serve as the reference the fast versions must equal.

Known difference: for a node born as a split's upper piece, this version names the node
itself as its parent (the split event does not carry the parent); derived.py follows the
split node back to the parent it had then.

SQLite text with index hints: a test reference, never a kvscope read (those are Core).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from sqlalchemy import Engine, text


def frame(engine: Engine, sql: str, **params: Any) -> pd.DataFrame:
    with engine.connect() as conn:
        result = conn.execute(text(sql), params)
        return pd.DataFrame([tuple(row) for row in result.fetchall()], columns=list(result.keys()))


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


def eviction_log(engine: Engine, run_id: int, limit: int, offset: int) -> pd.DataFrame:
    with engine.connect() as conn:
        has_index = conn.execute(text("SELECT 1 FROM sqlite_master WHERE name = 'ix_events_node'")).first()
    by_node = "INDEXED BY ix_events_node" if has_index else ""
    return frame(engine, EVICTION_LOG.replace("{by_node}", by_node), run=run_id, limit=limit, offset=offset)


def running_lengths(engine: Engine, run_id: int, step: int) -> pd.DataFrame:
    return frame(engine, RUNNING_LENGTHS, run=run_id, step=step)
