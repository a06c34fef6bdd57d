"""Reads about who shares the cache with whom (tenant isolation, the scoped radix cache):
the run's principals, promotions and demotions over steps, and cross-principal reuse.

NOTE: definitions (also shown on the dashboard)
    principals            the distinct principals of the run's requests and match events
    cross-principal share cross_hit tokens / matched tokens: of the tokens prefix matches reused,
                          the part that sat in nodes another principal owns. Only captures of
                          schema version 3 record cross_hit events and the requester of a match;
                          an older capture has neither (its reads come back empty).
Every aggregate is computed in SQL (grouped by step or principal), never row by row.
"""

from __future__ import annotations

import pandas as pd
from sqlalchemy import func, select, union

from kvscope.telemetry import schema
from kvscope.telemetry.events import EventKind
from kvscope.telemetry.queries import Capture

VISIBILITY_KINDS = (EventKind.PROMOTE.value, EventKind.DEMOTE.value)
REUSE_KINDS = (EventKind.MATCH.value, EventKind.CROSS_HIT.value)
REUSE_COLUMNS = ("principal", "matched_tokens", "cross_tokens")


def run_principals(capture: Capture, run_id: int) -> list[str]:
    """The distinct principals of the run's requests and match events, sorted."""
    r, e = schema.requests.c, schema.events.c
    of_requests = select(r.principal).where(r.run_id == run_id, r.principal.is_not(None)).distinct()
    if capture.schema_version < schema.since_version(e.principal):
        return sorted(str(p) for p in capture.read_frame(of_requests).iloc[:, 0])
    of_matches = select(e.principal).where(e.run_id == run_id, e.kind == EventKind.MATCH.value,
                                           e.principal.is_not(None))
    return sorted(str(p) for p in capture.read_frame(union(of_requests, of_matches)).iloc[:, 0])


def visibility_changes(capture: Capture, run_id: int) -> pd.DataFrame:
    """Promotions and demotions per step: step, kind, num_events, num_tokens."""
    e = schema.events.c
    stmt = (select(e.step, e.kind, func.count().label("num_events"), func.sum(e.num_tokens).label("num_tokens"))
            .where(e.run_id == run_id, e.kind.in_(VISIBILITY_KINDS)).group_by(e.step, e.kind).order_by(e.step))
    return capture.read_frame(stmt)


def reuse_by_principal(capture: Capture, run_id: int) -> pd.DataFrame:
    """Per requesting principal (None: not recorded): tokens its matches reused and the part of
    them in nodes another principal owns. Empty before schema version 3."""
    if capture.schema_version < 3:
        return pd.DataFrame(columns=list(REUSE_COLUMNS))
    e = schema.events.c
    stmt = (select(e.principal, e.kind, func.sum(e.num_tokens).label("num_tokens"))
            .where(e.run_id == run_id, e.kind.in_(REUSE_KINDS)).group_by(e.principal, e.kind))
    sums = capture.read_frame(stmt)
    if sums.empty:
        return pd.DataFrame(columns=list(REUSE_COLUMNS))
    table = sums.pivot_table(index="principal", columns="kind", values="num_tokens", aggfunc="sum",
                             fill_value=0, dropna=False)
    table = table.reindex(columns=list(REUSE_KINDS), fill_value=0).astype(int).rename_axis(columns=None).reset_index()
    return table.rename(columns={"match": "matched_tokens", "cross_hit": "cross_tokens"})[list(REUSE_COLUMNS)]
