"""The Radix tree page's node details as a person reads them, and the node a click on the icicle
picked. Pure functions: no Streamlit.

NOTE: one node's details are one record of about fifteen fields: shown as a field / value table
(two columns), they fit any window, where a row of fifteen columns needed 51-132 px of sideways
scrolling at 1440 px. Each field's name carries its unit; page hashes are short hex, not the raw
bytes (which a table prints as a list of decimal numbers).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from kvscope.dashboard.timing import Clock
from kvscope.telemetry.page_hash import split_page_hashes

HASH_HEX_CHARS = 8  # NOTE: the first 4 of a page hash's 8 bytes: enough to tell pages apart by eye
SHOWN_HASHES = 3
NOT_KNOWN = "–"


def short_hashes(blob: Any) -> str:
    """A node's page hashes as 'N pages: 1a2b3c4d 5e6f7081 … (+M)' (– when not recorded)."""
    raw = blob if isinstance(blob, bytes | bytearray | memoryview) else None
    hashes = split_page_hashes(bytes(raw)) if raw is not None else []
    if not hashes:
        return NOT_KNOWN
    shown = " ".join(h.hex()[:HASH_HEX_CHARS] for h in hashes[:SHOWN_HASHES])
    more = f" … (+{len(hashes) - SHOWN_HASHES:,})" if len(hashes) > SHOWN_HASHES else ""
    return f"{len(hashes):,} page{'' if len(hashes) == 1 else 's'}: {shown}{more}"


def _count(value: Any) -> str:
    return NOT_KNOWN if value is None or pd.isna(value) else f"{int(value):,}"


def _text(value: Any) -> str:
    return value if isinstance(value, str) and value else NOT_KNOWN


def _access(row: pd.Series, clock: Clock | None, counter_clock: bool) -> tuple[tuple[str, str], tuple[str, str]]:
    """(last access, idle) fields: the cache's access counter, or wall-clock time and seconds."""
    access, idle = row.get("last_access_time"), row.get("idle")
    known = access is not None and not pd.isna(access) and math.isfinite(float(access))
    if counter_clock:
        return ("last access (order)", _count(access) if known else NOT_KNOWN), (
            "idle (accesses since)",
            _count(idle) if known else NOT_KNOWN,
        )
    when = clock.stamp(float(access)) if clock is not None and known else NOT_KNOWN
    seconds = f"{float(idle):,.3f}" if known and idle is not None and not pd.isna(idle) else NOT_KNOWN
    return ("last access (wall clock)", when), ("idle (s, before the newest access)", seconds)


def details_frame(
    row: pd.Series, clock: Clock | None, counter_clock: bool, refs: bool, show_preview: bool
) -> pd.DataFrame:
    """One node (a row of charts.subtree_values' table) as field / value pairs, units in the names.
    `counter_clock`: the cache stamps accesses with a counter; `refs`: lock_ref is a block's ref count."""
    parent = row.get("parent_id")
    last_access, idle = _access(row, clock, counter_clock)
    fields = [
        ("node", f"#{int(row['node_id'])}"),
        ("parent", "none (the root)" if parent is None or pd.isna(parent) else f"#{int(parent)}"),
        ("tokens (the node's own)", _count(row.get("num_tokens"))),
        ("subtree (tokens, the node and all below)", _count(row.get("value"))),
        ("depth (tokens, root to the node's end)", _count(row.get("depth_tokens"))),
        ("ref count (requests holding the block)" if refs else "locks (requests holding it)", _count(row["lock_ref"])),
        ("hits (prefix matches through it)", _count(row.get("hit_count"))),
        last_access,
        idle,
        ("owner (principal that inserted it)", _text(row.get("owner"))),
        ("visibility", _text(row.get("visibility"))),
        ("tier", _text(row.get("tier"))),
        ("tombstone", "yes" if bool(row.get("tombstone")) else "no"),
        ("page hashes (hex, first 4 bytes each)", short_hashes(row.get("page_hashes"))),
    ]
    if show_preview:
        fields.append(("token preview", _text(row.get("token_preview"))))
    return pd.DataFrame(fields, columns=["field", "value"])


def clicked_node(event: Any) -> int | None:
    """The node a click on the icicle picked: the id of the selection's first point (st.plotly_chart's
    event with on_select); None when nothing is selected or the id is not a node id."""
    try:
        points = event["selection"]["points"]
    except (KeyError, TypeError):
        return None
    if not points:
        return None
    node = points[0].get("id") if isinstance(points[0], dict) else None
    try:
        return int(str(node))
    except ValueError:
        return None
