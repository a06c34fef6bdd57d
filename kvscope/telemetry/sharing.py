"""Reads about who shares the cache with whom (tenant isolation, the scoped radix cache):
the run's principals, promotions and demotions over steps, and cross-principal reuse.

NOTE: definitions (also shown on the dashboard)
    principals            the distinct principals of the run's requests and match events
    cross-principal share cross_hit tokens / matched tokens: of the tokens prefix matches reused,
                          the part that sat in nodes another principal owns. Only captures of
                          schema version 3 record cross_hit events and the requester of a match;
                          an older capture has neither (its reads come back empty).
Events are read through Capture.events (either layout), only the kinds and columns a read needs;
every aggregate is pandas over those columns (grouped by step or principal), never row by row.
"""

from __future__ import annotations

import pandas as pd

from kvscope.telemetry import schema
from kvscope.telemetry.event_source import match_principals
from kvscope.telemetry.events import EventKind
from kvscope.telemetry.queries import Capture

VISIBILITY_KINDS = (EventKind.PROMOTE, EventKind.DEMOTE)
REUSE_KINDS = (EventKind.MATCH, EventKind.CROSS_HIT)
REUSE_COLUMNS = ("principal", "matched_tokens", "cross_tokens")
VISIBILITY_COLUMNS = ("step", "kind", "num_events", "num_tokens")


def run_principals(capture: Capture, run_id: int) -> list[str]:
    """The distinct principals of the run's requests and match events, sorted: the requests' by
    their index (Capture.request_principals), the match events' from the chunks' summaries."""
    found = set(capture.request_principals(run_id))
    if capture.schema_version >= schema.since_version(schema.events.c.principal):
        found.update(match_principals(capture, run_id))
    return sorted(found)


def visibility_changes(capture: Capture, run_id: int) -> pd.DataFrame:
    """Promotions and demotions per step: step, kind, num_events, num_tokens."""
    changes = capture.events(run_id, kinds=VISIBILITY_KINDS, limit=None, columns=["step", "kind", "num_tokens"])
    if changes.empty:
        return pd.DataFrame(columns=list(VISIBILITY_COLUMNS))
    out = changes.groupby(["step", "kind"], sort=True).agg(num_events=("seq", "size"), num_tokens=("num_tokens", "sum"))
    return out.reset_index()[list(VISIBILITY_COLUMNS)]


def reuse_by_principal(capture: Capture, run_id: int) -> pd.DataFrame:
    """Per requesting principal (None: not recorded): tokens its matches reused and the part of
    them in nodes another principal owns. Empty before schema version 3."""
    if capture.schema_version < 3:
        return pd.DataFrame(columns=list(REUSE_COLUMNS))
    if capture.packed.has_chunks(run_id):  # NOTE: summed as it was written (packed.summaries, SummaryFold)
        grouped = capture.packed.grouped(run_id, capture.schema_version, "reuse")
        reuse = pd.DataFrame(grouped, columns=["principal", "kind", "num_tokens"]).astype({"principal": object})
    else:
        reuse = capture.events(run_id, kinds=REUSE_KINDS, limit=None, columns=["kind", "principal", "num_tokens"])
    if reuse.empty:
        return pd.DataFrame(columns=list(REUSE_COLUMNS))
    sums = reuse.groupby(["principal", "kind"], dropna=False, sort=True)["num_tokens"].sum().reset_index()
    # NOTE: a NULL principal is a group of its own, named None (as SQL's GROUP BY gives it), not NaN
    sums["principal"] = sums["principal"].astype(object).where(sums["principal"].notna(), None)
    table = sums.pivot_table(
        index="principal", columns="kind", values="num_tokens", aggfunc="sum", fill_value=0, dropna=False
    )
    table = table.reindex(columns=[k.value for k in REUSE_KINDS], fill_value=0).astype(int)
    table = table.rename_axis(columns=None).reset_index()
    return table.rename(columns={"match": "matched_tokens", "cross_hit": "cross_tokens"})[list(REUSE_COLUMNS)]
