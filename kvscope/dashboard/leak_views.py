"""The Leaks page's pure builders: the terms at one idle check, the culprit table, the locked
path of a lock that was never released, and who holds the locks on a node (pure: DataFrames
and the report's Leak records in, frames and figures out).

NOTE: a lock on a tree node holds the whole path from the node to the root (SGLang's
inc_lock_ref walks up), and a node split after the lock moves the node's upper tokens into a
new parent that the lock still covers. So for one leaked lock on node N:
    slots in the report    N's slots now (what the slot ledger holds for N at the end)
    slots when locked      N's slots now + the slots of the nodes split off above N since
                           (what an injected lock-leak records: N's slots at the lock)
    slots on the path      every slot from N up to the root: what stays protected (shared
                           with other locks on the same path)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvscope.dashboard.charts.style import color, count_axis
from kvscope.debug import Leak, LeakKind
from kvscope.telemetry.event_source import present

CHECK_TERMS = ("available", "evictable", "protected", "held", "uncached", "missing")
POOL_TITLES = {"full": "full pool", "swa": "SWA pool", "req": "request pool (rows)", "host": "host pool"}
MAX_RANGES = 4
_NO_HOLDER = "\0"  # NOTE: the group key of a lock without a holder (groupby drops NA keys)


def check_terms(checks: pd.DataFrame) -> pd.DataFrame:
    """The checks with a `missing` column: total minus the five terms (leaked slots)."""
    out = checks.copy()
    terms = [t for t in CHECK_TERMS if t != "missing"]
    out["missing"] = out["total"].astype(int) - out[terms].astype(int).sum(axis=1)
    return out


def check_terms_figure(at_check: pd.DataFrame) -> go.Figure:
    """One idle check: a bar per term, a panel per pool, each bar labelled with its count and the
    panel with the pool's total (the terms must add up to it)."""
    rows = check_terms(at_check).sort_values("pool")
    titles = [
        f"{POOL_TITLES.get(str(r.pool), str(r.pool))}: total {int(r.total):,}" + ("" if bool(r.ok) else " · FAILED")
        for r in rows.itertuples()
    ]
    fig = make_subplots(rows=1, cols=len(rows), subplot_titles=titles)
    for col, row in enumerate(rows.itertuples(), 1):
        values = [int(getattr(row, term)) for term in CHECK_TERMS]
        fig.add_trace(
            go.Bar(
                x=list(CHECK_TERMS),
                y=values,
                text=[f"{v:,}" for v in values],
                textposition="outside",
                marker_color=[color(term) for term in CHECK_TERMS],
                showlegend=False,
                hovertemplate="%{x}: %{y:,} slots<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.update_yaxes(
            count_axis([0, *values, int(row.total)], "slots" if col == 1 else None),
            range=[0, max(*values, 1) * 1.2],
            row=1,
            col=col,
        )
    fig.update_layout(height=320, margin={"t": 50, "b": 10})
    return fig


def slot_ranges(slots: Sequence[int], limit: int = MAX_RANGES) -> str:
    """'1840–1842, 1900' style: consecutive slots as ranges, at most `limit` ranges shown."""
    ranges: list[tuple[int, int]] = []
    for slot in sorted(slots):
        if ranges and slot == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], slot)
        else:
            ranges.append((slot, slot))
    shown = [f"{a}–{b}" if b > a else f"{a}" for a, b in ranges[:limit]]
    more = f", … +{len(ranges) - limit} ranges" if len(ranges) > limit else ""
    return ", ".join(shown) + more


def _note(leak: Leak) -> str:
    """One line: when it happened, without what the other columns say (request, slots)."""
    if leak.kind == LeakKind.LOCK_NEVER_RELEASED:
        detail = f"locked at step {leak.allocated_step}, never unlocked"
    elif leak.kind == LeakKind.ORPHANED and leak.rid is not None:
        due = "" if leak.free_due_step is None else f"; the free was due at step {leak.free_due_step}"
        detail = f"allocated at step {leak.allocated_step}{due}"
    else:
        detail = re.sub(r" \(event #\d+\)", "", leak.detail)
    after = f"a consequence of #{leak.consequence_of}: " if leak.consequence_of else ""
    return after + detail


def culprit_table(leaks: Sequence[Leak]) -> pd.DataFrame:
    """One short row per leak: #, kind (and pool when not full), slots (count and ranges), the
    request, its user, the locked node and a one-line note."""
    rows = []
    for i, leak in enumerate(leaks, 1):
        rows.append(
            {
                "#": i,
                "kind": leak.kind if leak.pool == "full" else f"{leak.kind} ({leak.pool})",
                "slots": f"{len(leak.slots):,}: {slot_ranges(leak.slots)}" if leak.slots else "0",
                "request": leak.rid,
                "user": leak.principal,
                "node": str(leak.node_id)
                if leak.kind == LeakKind.LOCK_NEVER_RELEASED and leak.node_id is not None
                else "",
                "note": _note(leak),
            }
        )
    return pd.DataFrame(rows, columns=["#", "kind", "slots", "request", "user", "node", "note"])


def split_off_since(node_id: int, since_seq: int, splits: pd.DataFrame) -> list[tuple[int, int]]:
    """(new node, step) of every split after `since_seq` that cut tokens off the node, or off a
    node cut from it, in order: these nodes now hold the node's upper tokens as it was then."""
    cut = {node_id}
    found: list[tuple[int, int]] = []
    for row in splits[splits["seq"] > since_seq].sort_values("seq").itertuples():
        if int(row.aux) in cut:
            cut.add(int(row.node_id))
            found.append((int(row.node_id), int(row.step)))
    return found


def lock_paths(leaks: Sequence[Leak], tree: pd.DataFrame, splits: pd.DataFrame) -> pd.DataFrame:
    """Per leaked lock: the node's slots in the report, its slots when locked (splits since put
    back together), the nodes split off it and the slots on its path to the root (`tree` is the
    node table at the run's last step, with depth_tokens)."""
    tokens = dict(zip(tree["node_id"].astype(int), tree["num_tokens"].astype(int), strict=True))
    depth = dict(zip(tree["node_id"].astype(int), tree["depth_tokens"].astype(int), strict=True))
    rows = []
    for leak in leaks:
        if leak.kind != LeakKind.LOCK_NEVER_RELEASED or leak.node_id is None:
            continue
        node = int(leak.node_id)
        split = split_off_since(node, leak.allocated_event if leak.allocated_event is not None else -1, splits)
        rows.append(
            {
                "node": node,
                "request": leak.rid,
                "locked at step": leak.allocated_step,
                "slots in the report": len(leak.slots),
                "slots when locked": tokens.get(node, len(leak.slots)) + sum(tokens.get(n, 0) for n, _ in split),
                "split off since": ", ".join(f"node {n} at step {s} ({tokens.get(n, 0)} slots)" for n, s in split)
                or "–",
                "slots on the path to the root": depth.get(node),
            }
        )
    return pd.DataFrame(
        rows,
        columns=[
            "node",
            "request",
            "locked at step",
            "slots in the report",
            "slots when locked",
            "split off since",
            "slots on the path to the root",
        ],
    )


def lock_holder(row: Any) -> Any:
    """Who holds a lock event's lock: its request, or (hiradix) the copy in flight that took it,
    named "write 7" / "load 9" (a copy lock has no request; its reason names the copy, aux the op)."""
    if pd.isna(row.rid) and isinstance(row.reason, str) and row.reason in ("write", "load"):
        return f"{row.reason} {int(row.aux)}"
    return row.rid


def lock_holders_of(locks: pd.DataFrame) -> pd.Series:
    """lock_holder of every row, at once (rids as strings, or as codes: see held_locks)."""
    holder = locks["rid"].astype(object)
    if "reason" not in locks:
        return holder
    copy = ~present(locks["rid"]) & locks["reason"].isin(["write", "load"])
    if copy.any():
        named = locks.loc[copy, "reason"].astype(str) + " " + locks.loc[copy, "aux"].astype("int64").astype(str)
        holder = holder.where(~copy, named)
    return holder


def held_locks(
    locks: pd.DataFrame, step: int, decode: Callable[[np.ndarray], np.ndarray] | None = None
) -> pd.DataFrame:
    """The locks held after `step`: node_id, rid (the holder: a request, or a host-tier copy) and
    the step it was taken (an unlock releases the latest lock of the same holder on the same
    node, as the slot ledger does; an unlock with none held releases nothing). `locks` may hold
    rids as codes (Capture.events `coded`); `decode` then names the holders found.

    NOTE: per (node, holder), in seq order, the stack height after each event is the running sum
    of +1 (lock) / -1 (unlock) reflected at 0: s = c - min(0, running min of c). The lock that
    brought the stack to height h is released by the first later event that takes it below h, so
    a lock is still held iff no later event of its group has a smaller height (no loop per event:
    a 10M-event capture has ~700k lock events)."""
    rows = locks[(locks["step"] <= step) & locks["node_id"].notna()].sort_values("seq", kind="stable")
    if rows.empty:
        return pd.DataFrame(columns=["node_id", "rid", "since_step"])
    holder = lock_holders_of(rows)
    nodes = rows["node_id"].astype("int64").to_numpy()
    group = (
        pd.DataFrame({"node": nodes, "holder": holder.where(holder.notna(), _NO_HOLDER).to_numpy()})
        .groupby(["node", "holder"], sort=False)
        .ngroup()
        .to_numpy()
    )
    is_lock = (rows["kind"] == "lock").to_numpy()
    summed = pd.Series(np.where(is_lock, 1, -1)).groupby(group).cumsum()
    height = (summed - np.minimum(summed.groupby(group).cummin(), 0)).to_numpy()
    lowest_after = pd.Series(height[::-1]).groupby(group[::-1]).cummin().to_numpy()[::-1]
    held = is_lock & (lowest_after >= height)
    holders = holder.to_numpy()[held]
    if decode is not None:
        holders = _decoded(holders, decode)
    return pd.DataFrame(
        {"node_id": nodes[held], "rid": holders, "since_step": rows["step"].astype("int64").to_numpy()[held]}
    )


def _decoded(holders: np.ndarray, decode: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Holders as names: rid codes decoded at once (copies are named already)."""
    out = holders.astype(object)
    coded = np.fromiter((isinstance(h, int | np.integer) for h in out), bool, len(out))
    if coded.any():
        out[coded] = decode(out[coded].astype(np.int64))
    return out


def holders_of(node_id: int, held: pd.DataFrame, tree: pd.DataFrame) -> pd.DataFrame:
    """The requests whose locks hold `node_id`: a lock on the node itself or on any node below
    it (a lock holds the path up to the root). Columns: rid, locked node, since step."""
    parent = {int(n): (None if pd.isna(p) else int(p)) for n, p in zip(tree["node_id"], tree["parent_id"], strict=True)}
    rows = []
    for lock in held.itertuples():
        node: int | None = int(lock.node_id)
        while node is not None and node != node_id:
            node = parent.get(node)
        if node == node_id:
            rows.append({"request": lock.rid, "locked node": int(lock.node_id), "since step": int(lock.since_step)})
    return pd.DataFrame(rows, columns=["request", "locked node", "since step"])


TAKES = ("alloc", "lock")  # NOTE: a ref-counted block source (the probe): alloc and touch take a reference,
RELEASES = ("free", "unlock")  # free (to ref 0) and unlock (still referenced) release one


def block_holders(events: pd.DataFrame, step: int, block: int) -> pd.DataFrame:
    """The requests holding a reference on `block` after `step`, from a block source's events
    (seq, step, kind, rid, blocks: a list of block ids per event): per request, its takes minus
    its releases of the block, never below 0. Columns: request, references, since step, by
    (the event of the latest take)."""
    rows = events[(events["step"] <= step) & events["kind"].isin(TAKES + RELEASES)].sort_values("seq", kind="stable")
    held: dict[str, list[Any]] = {}
    for event in rows.itertuples():
        if block not in event.blocks:
            continue
        rid = str(event.rid) if isinstance(event.rid, str) else "(no request)"
        count, since, by = held.get(rid, [0, None, None])
        if event.kind in TAKES:
            held[rid] = [count + 1, int(event.step), str(event.kind)]
        else:
            held[rid] = [max(count - 1, 0), since, by]
    found = [
        {"request": rid, "references": n, "since step": since, "by": "touch (prefix hit)" if by == "lock" else by}
        for rid, (n, since, by) in held.items()
        if n > 0
    ]
    return pd.DataFrame(found, columns=["request", "references", "since step", "by"])


# NOTE: a census term's message names its blocks as kvscope.probe.census writes them: "block B ref R,
# accounted A; last taken by request X (EVENT at step S)" (leaked) or "... last released for request X
# (...)" (lostref); at most census.MAX_NAMED blocks per term, the rest counted
_BLOCK_TEXT = re.compile(
    r"block (\d+) ref (\d+), accounted (\d+)(?:; last (taken by|released for) request (\S+) "
    r"\((\S+) at step (\d+)\))?"
)
CENSUS_COLUMNS = ["term", "block", "ref count", "accounted", "request", "event", "at step"]


def census_culprits(checks: pd.DataFrame, step: int) -> pd.DataFrame:
    """The blocks the failing census terms at `step` name, one row each: the term, the block, its
    ref count and accounted references, and the request that last took it (leaked) or that it was
    last released for (lostref), with the event and its step. Terms that name no block by ref
    (unqueued, qheld, qcount, orphans) are one row with their message's list in `request`."""
    failed = checks[(checks["step"] == step) & ~checks["ok"].astype(bool)] if not checks.empty else checks
    rows = []
    for check in failed.itertuples():
        text = census_violation(str(check.message or ""))
        found = list(_BLOCK_TEXT.finditer(text))
        for match in found:
            block, ref, accounted, _, rid, event, at = match.groups()
            rows.append(
                {
                    "term": str(check.pool),
                    "block": int(block),
                    "ref count": int(ref),
                    "accounted": int(accounted),
                    "request": None if rid in (None, "None") else rid,
                    "event": event,
                    "at step": None if at is None else int(at),
                }
            )
        if not found:
            rows.append(
                {
                    "term": str(check.pool),
                    "block": None,
                    "ref count": None,
                    "accounted": None,
                    "request": text,
                    "event": None,
                    "at step": None,
                }
            )
    return pd.DataFrame(rows, columns=CENSUS_COLUMNS)


def census_violation(message: str) -> str:
    """A census check's message without its counts ("[term] total=..., uncached=N: <this>")."""
    head, _, rest = message.partition("]")
    return rest.split(": ", 1)[1] if head.startswith("[") and ": " in rest else message


def census_table(checks: pd.DataFrame) -> pd.DataFrame:
    """One row per idle census (step): each term's outcome (ok / FAILED) and the pool's counts."""
    if checks.empty:
        return pd.DataFrame(columns=["step"])
    outcome = checks.assign(outcome=checks["ok"].astype(bool).map({True: "ok", False: "FAILED"}))
    table = outcome.pivot_table(index="step", columns="pool", values="outcome", aggfunc="first")
    counts = checks.groupby("step")[["total", "available", "evictable", "held", "uncached"]].first()
    counts.columns = ["blocks", "free", "cached free", "held", "ref 0, not queued"]
    return table.join(counts).reset_index()
