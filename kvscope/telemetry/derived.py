"""Derived reads over a capture's events, for the dashboard: the eviction log (age, idle,
regret), running requests' lengths at a step, the requests in flight, eviction rates. Each returns a DataFrame.

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
    in flight      a request that arrived in a step range and had not finished or been aborted
                   by its end: running when its latest life event is its admission, else waiting

NOTE: cost. Every read goes through Capture.events (either layout: event_source.py) and asks
for the kinds and columns it needs, with a step range where the definition bounds it (running
lengths, recent evictions), so a packed run skips the chunks without those kinds or steps; the
filters by node, rid and pool and every join or aggregate are numpy/pandas over those columns,
never one read or one Python step per event. The eviction log reads the run's node touches
(insert, split, match, lock) once per page and loops over that page's evictions only. A run of
the row layout (written before version 6) reads the same columns through SQL, which is slower
on a big run: `kvscope upgrade` packs it.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import desc, select

from kvscope.telemetry import schema
from kvscope.telemetry.carry import (
    EVICT_STEP_DTYPE,
    held_after,
    holder_names,
    lock_carry,
    read_evict_steps,
    read_lock_carry,
    read_miss_nodes,
    read_request_carry,
    request_carry,
    running_after,
)
from kvscope.telemetry.event_source import decode_strings, present
from kvscope.telemetry.events import EventKind, PoolName
from kvscope.telemetry.packed import NO_CODE, NULL_INT
from kvscope.telemetry.queries import Capture

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
EVICT = EventKind.EVICT
ENDS = (EventKind.REQUEST_FINISH, EventKind.REQUEST_ABORT, EventKind.REQUEST_RETRACT)
NODE_TOUCHES = (EventKind.INSERT, EventKind.SPLIT, EventKind.MATCH, EventKind.LOCK)
BIRTHS = (EventKind.INSERT, EventKind.SPLIT)
FIRST_STEP = -(1 << 62)  # a step range's open end
LAST_STEP = 1 << 62
Touch = tuple[int, str, int]  # (seq, kind, aux)
Match = tuple[int, int]  # (seq, miss tokens)


def _all(
    capture: Capture,
    run_id: int,
    kinds: Sequence[EventKind],
    columns: Sequence[str],
    step_range: tuple[int, int] | None = None,
    coded: Sequence[str] = (),
    after_seq: int | None = None,
) -> pd.DataFrame:
    """Every event of `kinds` (in `step_range`, after `after_seq`), as `columns` plus seq, in seq
    order (`coded`: string columns left as codes, see Capture.events)."""
    return capture.events(
        run_id, kinds=kinds, step_range=step_range, after_seq=after_seq, limit=None, columns=columns, coded=coded
    )


def _isin(values: pd.Series, wanted: Iterable[int]) -> np.ndarray:
    """values (ints, or floats with NaN for NULL) in `wanted`: a bool mask (NULL never is)."""
    keys = np.unique(np.fromiter(wanted, np.int64))
    array = values.to_numpy()
    if not len(keys) or not len(array):
        return np.zeros(len(array), bool)
    if array.dtype.kind in "iu":
        present = np.ones(len(array), bool)
        array = array.astype(np.int64)
    else:  # NOTE: floats with NaN, or objects with None (every value NULL)
        present = pd.notna(array)
        array = np.where(present, array, 0).astype(np.int64)
    at = np.minimum(np.searchsorted(keys, array), len(keys) - 1)
    return present & (keys[at] == array)


# -- eviction log ----------------------------------------------------------------------------


def eviction_log(capture: Capture, run_id: int, limit: int, offset: int) -> pd.DataFrame:
    """One page of the log (evictions in event order), with age, idle, parent and regret.

    NOTE: three reads, bounded by the page. A row's birth, last touch and parent come from touches
    (insert, split, match, lock) before its eviction, so the touches before the page's last
    eviction are read, as kind, node and aux alone; its regret is the first later match that
    missed at its node or parent, read from the few chunks whose miss_nodes name them
    (_later_matches); then the step, time and request of the few touches the page names are read
    by seq."""
    ev = capture.events(
        run_id,
        kinds=[EVICT],
        limit=limit,
        offset=offset,
        columns=["seq", "step", "t_mono", "pool", "node_id", "num_tokens", "reason"],
    )
    ev = ev.rename(columns={"num_tokens": "evicted_tokens"})
    if ev.empty:
        return pd.DataFrame(columns=list(EVICTION_LOG_COLUMNS))
    touches = capture.events(
        run_id, kinds=NODE_TOUCHES, limit=None, columns=["kind", "node_id", "aux"], before_seq=int(ev.seq.max())
    )
    nodes = sorted({int(n) for n in ev.node_id})
    history = _NodeHistory(touches)
    history.load_chains(nodes)
    parents = [history.parent_at(int(n), int(s)) for n, s in zip(ev.node_id, ev.seq, strict=True)]
    later = _later_matches(capture, run_id, ev, parents)
    found = []
    for row, parent in zip(ev.itertuples(index=False), parents, strict=True):
        again = min(
            (m for m in (later.first_after(row.node_id, row.seq), later.first_after(parent, row.seq)) if m is not None),
            default=None,
            key=lambda m: m[0],
        )
        found.append((history.born(row.node_id, row.seq), history.last_touch(row.node_id, row.seq), again))
    named = {r[0] for trio in found for r in trio if r is not None}
    details = capture.events(
        run_id, kinds=NODE_TOUCHES, limit=None, columns=["step", "t_mono", "rid"], seqs=sorted(named)
    )
    at = {
        int(d.seq): (int(d.step), float(d.t_mono), None if pd.isna(d.rid) else d.rid)
        for d in details.itertuples(index=False)
    }
    rows = []
    for row, parent, (born, touch, again) in zip(ev.itertuples(index=False), parents, found, strict=True):
        b, t, a = (None if r is None else at[r[0]] for r in (born, touch, again))
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
                None if b is None else row.step - b[0],
                None if b is None else row.t_mono - b[1],
                None if t is None else row.step - t[0],
                None if t is None else row.t_mono - t[1],
                None if a is None else a[0],
                None if a is None else a[2],
                0 if again is None else min(int(row.evicted_tokens), int(again[1])),
            )
        )
    return pd.DataFrame(rows, columns=list(EVICTION_LOG_COLUMNS))


class _NodeHistory:
    """Births, touches and splits of a set of nodes, picked out of the run's touches (seq order;
    a touch here is (seq, kind, aux): eviction_log reads the rest of the few it needs)."""

    def __init__(self, touches: pd.DataFrame) -> None:
        self.touches = touches
        self.is_split = (touches["kind"] == EventKind.SPLIT.value).to_numpy()
        self.rows: dict[int, list[Touch]] = defaultdict(list)
        self.splits_of: dict[int, list[tuple[int, int]]] = defaultdict(list)  # node -> [(seq, upper node)]
        self.loaded: set[int] = set()

    def load(self, nodes: Iterable[int]) -> list[int]:
        """Pick out the rows of `nodes` not loaded yet; returns those nodes."""
        todo = sorted(set(nodes) - self.loaded)
        if not todo:
            return todo
        self.loaded.update(todo)
        t = self.touches
        own = t[_isin(t["node_id"], todo)]
        for r in own[["seq", "kind", "node_id", "aux"]].itertuples(index=False):
            self.rows[int(r.node_id)].append((int(r.seq), str(r.kind), int(r.aux)))
        splits = t[self.is_split & _isin(t["aux"], todo)]
        for r in splits[["seq", "node_id", "aux"]].itertuples(index=False):
            self.splits_of[int(r.aux)].append((int(r.seq), int(r.node_id)))
        return todo

    def load_chains(self, nodes: Iterable[int]) -> None:
        """Load `nodes` and, hop by hop, the split nodes their upper pieces came from: parent_at
        then finds every node it visits loaded (one pass over the touches per hop, not per node)."""
        todo = self.load(nodes)
        for _ in range(MAX_PARENT_HOPS):
            came_from = {r[2] for n in todo for r in self.rows[n] if r[1] == EventKind.SPLIT}
            todo = self.load(came_from)
            if not todo:
                return

    def born(self, node: int, before: int) -> Touch | None:
        return next((r for r in self.rows[node] if r[1] in BIRTHS and r[0] < before), None)

    def last_touch(self, node: int, before: int) -> Touch | None:
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
            if born[1] == EventKind.INSERT:
                return born[2]
            node, seq = born[2], born[0]  # an upper piece: the parent the split node had then
        return None


class _LaterMatches:
    def __init__(self) -> None:
        self.by_node: dict[int, list[Match]] = defaultdict(list)

    def add(self, frame_: pd.DataFrame) -> None:
        """Matches (seq, node_id, aux) later than every one added before."""
        for r in frame_.itertuples(index=False):
            self.by_node[int(r.node_id)].append((int(r.seq), int(r.aux)))

    def first_after(self, node: int | None, seq: int) -> Match | None:
        if node is None:
            return None
        matches = self.by_node.get(node, [])
        index = bisect.bisect_right(matches, seq, key=lambda m: m[0])
        return matches[index] if index < len(matches) else None


def _later_matches(capture: Capture, run_id: int, ev: pd.DataFrame, parents: Sequence[int | None]) -> _LaterMatches:
    """Matches that stopped at an evicted node of `ev` or its parent after the page's first eviction
    and missed tokens: enough of them that each row's first such match after its own eviction is
    among them. A packed run reads, per row, the chunks whose miss_nodes (carry.py) name its node or
    parent, in seq order until one holds such a match (at most the eviction's own chunk and one
    more); a run of the row layout reads every match after the page's first eviction."""
    rows = [(int(s), int(n), p) for s, n, p in zip(ev.seq, ev.node_id, parents, strict=True)]
    wanted = sorted({n for _, n, _ in rows} | {p for _, _, p in rows if p is not None})
    after = int(ev.seq.min())
    chunks = capture.packed.carried(run_id, capture.schema_version, "miss_nodes")
    later = _LaterMatches()
    if chunks.empty:
        later.add(_misses_at(capture, run_id, wanted, after, None))
        return later
    chunks = chunks[(chunks.first_seq + chunks.num_events - 1 > after).to_numpy()].reset_index(drop=True)
    naming = _chunks_naming(chunks, wanted)
    read: dict[int, pd.DataFrame] = {}
    for seq, node, parent in rows:
        at = sorted({*naming.get(node, ()), *naming.get(parent, ())} if parent is not None else naming.get(node, ()))
        for index in at:
            first, end = int(chunks.first_seq[index]), int(chunks.first_seq[index] + chunks.num_events[index])
            if end - 1 <= seq:
                continue
            if index not in read:
                read[index] = _misses_at(capture, run_id, wanted, first - 1, end)
            misses = read[index]
            if ((misses.seq.to_numpy() > seq) & misses.node_id.isin([node, parent]).to_numpy()).any():
                break
    for index in sorted(read):
        later.add(read[index])
    return later


def _chunks_naming(chunks: pd.DataFrame, wanted: Sequence[int]) -> dict[int, list[int]]:
    """node -> the indexes (into `chunks`, ascending) of the chunks whose miss_nodes name it. NOTE: one
    isin over every chunk's nodes end to end, not one per chunk (about 10,000 chunks at 100 M events)."""
    parts = [read_miss_nodes(bytes(data)) for data in chunks.miss_nodes]
    nodes = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    index = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    named = np.isin(nodes, np.asarray(wanted, np.int64))
    out: dict[int, list[int]] = defaultdict(list)
    for node, at in zip(nodes[named].tolist(), index[named].tolist(), strict=True):
        out[node].append(at)
    return out


def _misses_at(capture: Capture, run_id: int, nodes: Sequence[int], after: int, before: int | None) -> pd.DataFrame:
    """seq, node_id, aux of the matches between `after` and `before` (exclusive) that stopped at one of
    `nodes` and missed tokens."""
    found = capture.events(
        run_id, kinds=[EventKind.MATCH], limit=None, columns=["node_id", "aux"], after_seq=after, before_seq=before
    )
    return found.loc[(found["aux"] > 0).to_numpy() & _isin(found["node_id"], nodes), ["seq", "node_id", "aux"]]


# -- running requests ------------------------------------------------------------------------


def running_lengths(capture: Capture, run_id: int, step: int) -> pd.DataFrame:
    """rid, seq_len of every request running at `step`: matched by then and not finished,
    aborted or retracted since its latest match (sorted by rid). NOTE: joins on rid codes;
    only the running requests' rids are decoded. A packed run's running requests come from its
    chunks' request carries (carry.py; events read only for the chunks that straddle `step`), a run
    of the row layout's from its match and end events."""
    coded = ("rid",)
    live = _running(capture, run_id, step)
    if live.empty:
        return pd.DataFrame({"rid": pd.Series(dtype=object), "seq_len": pd.Series(dtype="int64")})
    allocs = _all(
        capture, run_id, [EventKind.ALLOC], ["rid", "pool", "num_tokens"], (int(live.mstep.min()), step), coded
    )
    allocs = allocs[(allocs["pool"] == PoolName.FULL.value) & allocs["rid"].isin(list(live.rid))]
    since = allocs[["rid", "seq", "num_tokens"]].merge(live[["rid", "mseq"]], on="rid")
    grown = since[since.seq > since.mseq].groupby("rid")["num_tokens"].sum()
    live["seq_len"] = live["hit"] + live["rid"].map(grown).fillna(0).astype("int64")
    live["rid"] = decode_strings(capture, run_id, live["rid"])
    return live[["rid", "seq_len"]].sort_values("rid", kind="stable").reset_index(drop=True)


def _running(capture: Capture, run_id: int, step: int) -> pd.DataFrame:
    """rid (a code where the run has codes), mseq, mstep, hit of the requests running at `step`: each
    one's latest match."""
    coded = ("rid",)
    if not _has_chunks(capture, run_id):
        matches = _all(capture, run_id, [EventKind.MATCH], ["step", "rid", "num_tokens"], (FIRST_STEP, step), coded)
        latest = _last_per_rid(matches).rename(columns={"seq": "mseq", "step": "mstep", "num_tokens": "hit"})
        ends = _last_per_rid(_all(capture, run_id, ENDS, ["rid"], (FIRST_STEP, step), coded))
        live = latest.merge(ends.rename(columns={"seq": "eseq"}), on="rid", how="left")
        live = live[live.eseq.isna() | (live.eseq < live.mseq)]
        return live[["rid", "mseq", "mstep", "hit"]].reset_index(drop=True)
    chunks = capture.packed.carried(run_id, capture.schema_version, "request_carry", (FIRST_STEP, step))
    partial = chunks[chunks.last_step > step]
    events = pd.DataFrame(columns=["seq", *REQUEST_FIELDS])
    if len(partial):
        after = int(partial.first_seq.min()) - 1
        events = _all(
            capture, run_id, [EventKind.MATCH, *ENDS], REQUEST_FIELDS, (FIRST_STEP, step), ("kind", "rid"), after
        )
    carried = []
    for chunk in chunks.itertuples(index=False):
        if chunk.last_step <= step:
            carried.append(read_request_carry(bytes(chunk.request_carry)))
            continue
        first = int(chunk.first_seq)
        mine = events[(events.seq >= first) & (events.seq < first + int(chunk.num_events))]
        columns = {name: mine[name].to_numpy() for name in ["seq", *REQUEST_FIELDS]}
        code_of = lambda text: capture.packed.code_of(run_id, text)  # noqa: E731
        carried.append(read_request_carry(request_carry(columns, first, code_of)))
    opens = running_after(carried)
    return pd.DataFrame(
        {
            "rid": opens["rid"].astype(np.int64),
            "mseq": opens["seq"].astype(np.int64),
            "mstep": opens["step"].astype(np.int64),
            "hit": opens["hit"].astype(np.int64),
        }
    )


REQUEST_FIELDS = ["step", "kind", "rid", "num_tokens"]


IN_FLIGHT_COLUMNS = ("rid", "state", "arrive_step", "admit_step", "principal")
LIFE = (EventKind.REQUEST_ARRIVE, EventKind.REQUEST_ADMIT, *ENDS)


def in_flight(capture: Capture, run_id: int, since_step: int, step: int) -> pd.DataFrame:
    """Requests that arrived in steps since_step..step and had not finished or been aborted by
    `step`, newest arrival first: `state` running (admitted) or waiting (arrived, or retracted
    since its admission); arrive_step, admit_step (NaN: not admitted now), principal. A request
    that arrived before since_step is not read (the caller says so). NOTE: reads the life events
    of that step range only; rids stay codes until the end."""
    coded = ("rid",)
    life = _all(capture, run_id, LIFE, ["step", "kind", "rid", "principal"], (since_step, step), coded)
    life = life[present(life["rid"])]
    arrived = life[life["kind"] == EventKind.REQUEST_ARRIVE.value].drop_duplicates("rid", keep="first")
    latest = life.drop_duplicates("rid", keep="last").set_index("rid")
    admits = life[life["kind"] == EventKind.REQUEST_ADMIT.value].drop_duplicates("rid", keep="last").set_index("rid")
    out = arrived[["rid", "step", "principal"]].rename(columns={"step": "arrive_step"})
    last_kind = out["rid"].map(latest["kind"])
    ended = last_kind.isin([EventKind.REQUEST_FINISH.value, EventKind.REQUEST_ABORT.value])
    out = out[~ended.to_numpy()].copy()
    last_kind = last_kind[~ended]
    out["state"] = np.where(last_kind.to_numpy() == EventKind.REQUEST_ADMIT.value, "running", "waiting")
    out["admit_step"] = out["rid"].map(admits["step"]).where(out["state"] == "running")
    out["rid"] = decode_strings(capture, run_id, out["rid"])
    out = out.iloc[::-1]  # NOTE: newest arrival first (events are in seq order)
    return out[list(IN_FLIGHT_COLUMNS)].reset_index(drop=True)


def _last_per_rid(events: pd.DataFrame) -> pd.DataFrame:
    """Each rid's latest event (rids not NULL), by rid (by code, for rids read as codes)."""
    events = events[present(events["rid"])]
    return events.drop_duplicates("rid", keep="last").sort_values("rid", kind="stable").reset_index(drop=True)


def allocs_of_requests(capture: Capture, run_id: int, rids: Sequence[str]) -> pd.DataFrame:
    """rid, step, tokens: each request's full-pool allocations per step."""
    if not rids:
        return pd.DataFrame(columns=["rid", "step", "tokens"])
    allocs = capture.events(
        run_id,
        kinds=[EventKind.ALLOC],
        rids=list(rids),
        step_range=life_steps(capture, run_id, rids),
        limit=None,
        columns=["step", "rid", "pool", "num_tokens"],
    )
    allocs = allocs[allocs["pool"] == PoolName.FULL.value]
    if allocs.empty:
        return pd.DataFrame(columns=["rid", "step", "tokens"])
    sums = allocs.groupby(["rid", "step"], sort=True)["num_tokens"].sum()
    return sums.rename("tokens").reset_index()


def life_steps(capture: Capture, run_id: int, rids: Sequence[str]) -> tuple[int, int] | None:
    """The steps every event of these requests falls in: from their earliest arrival step to their latest
    finish step (no upper bound when one has none: unfinished or aborted); None (every step) when one has
    no row or no arrival step. NOTE: a request allocates only after it arrived (the probes mark arrival at
    its first lookup) and before it finished; the bound lets a packed run read only the chunks of those
    steps (a page of 60 requests read every chunk's rids: minutes at 100 M events)."""
    rows = capture.request_rows(run_id, rids=list(rids), columns=["arrive_step", "finish_step"], ordered=False)
    if len(rows) < len(set(rids)) or rows["arrive_step"].isna().any():
        return None
    last = LAST_STEP if rows["finish_step"].isna().any() else int(rows["finish_step"].max())
    return int(rows["arrive_step"].min()), last


# -- evictions over time ---------------------------------------------------------------------


def eviction_summary(capture: Capture, run_id: int) -> pd.DataFrame:
    """reason ('?' when none), pool, num_evictions, evicted_tokens, first_step, last_step per
    reason and pool, most evictions first (ties: by reason, then pool, NULL first). A packed run's
    from its chunks' summaries (packed.summaries), a run of the row layout's from its events."""
    columns = ["reason", "pool", "num_evictions", "evicted_tokens", "first_step", "last_step"]
    rows = _summed_evictions(capture, run_id) if _has_chunks(capture, run_id) else _evictions_of_events(capture, run_id)
    rows.sort(key=lambda r: (_null_first(r[0]), _null_first(r[1])))
    rows.sort(key=lambda r: -r[2])  # NOTE: stable: ties keep the (reason, pool) order, as SQL's GROUP BY gave it
    return pd.DataFrame([("?" if r[0] is None else r[0], *r[1:]) for r in rows], columns=columns)


def _has_chunks(capture: Capture, run_id: int) -> bool:
    return not capture.packed.chunks(run_id).empty


def _summed_evictions(capture: Capture, run_id: int) -> list[tuple[Any, ...]]:
    """(reason, pool, evictions, tokens, first step, last step) summed over the chunks' summaries."""
    total: dict[tuple[str | None, str | None], list[int]] = {}
    for reason, pool, count, tokens, first, last in capture.packed.grouped(run_id, capture.schema_version, "evictions"):
        found = total.setdefault((reason, pool), [0, 0, first, last])
        found[0], found[1] = found[0] + int(count), found[1] + int(tokens)
        found[2], found[3] = min(found[2], int(first)), max(found[3], int(last))
    return [(reason, pool, *values) for (reason, pool), values in total.items()]


def _evictions_of_events(capture: Capture, run_id: int) -> list[tuple[Any, ...]]:
    ev = _all(capture, run_id, [EVICT], ["step", "pool", "num_tokens", "reason"])
    if ev.empty:
        return []
    groups = ev.groupby(["reason", "pool"], dropna=False, sort=False).agg(
        num_evictions=("seq", "size"),
        evicted_tokens=("num_tokens", "sum"),
        first_step=("step", "min"),
        last_step=("step", "max"),
    )
    return [
        (_text(reason), _text(pool), *(int(v) for v in values))
        for (reason, pool), values in zip(groups.index, groups.itertuples(index=False), strict=True)
    ]


def lookup_stops(capture: Capture, run_id: int) -> pd.DataFrame:
    """Prefix lookups by why they stopped (the reason of the match events that name one): reason,
    lookups, hit_tokens, missed_tokens, by reason; empty when none names a reason. A packed run's from
    its chunks' summaries."""
    columns = ["reason", "lookups", "hit_tokens", "missed_tokens"]
    if _has_chunks(capture, run_id):
        total: dict[str, list[int]] = {}
        for reason, lookups, hit, missed in capture.packed.grouped(run_id, capture.schema_version, "stops"):
            found = total.setdefault(str(reason), [0, 0, 0])
            found[0], found[1], found[2] = found[0] + int(lookups), found[1] + int(hit), found[2] + int(missed)
        return pd.DataFrame([(r, *v) for r, v in sorted(total.items())], columns=columns)
    events = _all(capture, run_id, [EventKind.MATCH], ["reason", "num_tokens", "aux"])
    named = events[events["reason"].notna()]
    table = named.groupby("reason").agg(lookups=("reason", "size"), hit=("num_tokens", "sum"), missed=("aux", "sum"))
    return pd.DataFrame(
        [(str(r), *(int(v) for v in row)) for r, row in zip(table.index, table.itertuples(index=False), strict=True)],
        columns=columns,
    )


def _text(value: object) -> str | None:
    return None if value is None or value != value else str(value)  # NOTE: NaN != NaN


def _null_first(value: str | None) -> tuple[bool, str]:
    return (value is not None, value or "")


def evictions_over_steps(capture: Capture, run_id: int, max_points: int) -> pd.DataFrame:
    """Evictions and evicted tokens per bucket of steps (at most `max_points` buckets; `step` is
    each bucket's last step with an eviction, `steps` its width). A packed run's from its chunks'
    evictions per step (carry.py), a run of the row layout's from its events."""
    if _has_chunks(capture, run_id):
        carried = capture.packed.carried(run_id, capture.schema_version, "evict_steps")
        per_step = np.concatenate([read_evict_steps(bytes(b)) for b in carried.evict_steps] or [_NO_EVICT_STEPS])
        ev = pd.DataFrame(
            {
                "step": per_step["step"],
                "evictions": per_step["evictions"],
                "num_tokens": per_step["tokens"],
                "t_mono": per_step["t_mono"],
            }
        )
    else:
        ev = _all(capture, run_id, [EVICT], ["step", "t_mono", "num_tokens"]).assign(evictions=1)
    if ev.empty:
        return pd.DataFrame(columns=["step", "num_evictions", "evicted_tokens", "t_mono", "steps"])
    lo = int(ev.step.min())
    width = max(1, -(-(int(ev.step.max()) - lo + 1) // max_points))
    out = ev.groupby(((ev.step - lo) // width).to_numpy()).agg(
        step=("step", "max"),
        num_evictions=("evictions", "sum"),
        evicted_tokens=("num_tokens", "sum"),
        t_mono=("t_mono", "min"),
    )
    out = out.sort_values("step").reset_index(drop=True)
    out["steps"] = width
    return out


_NO_EVICT_STEPS = np.zeros(0, EVICT_STEP_DTYPE)


def recent_evictions(capture: Capture, run_id: int, since_step: int) -> pd.DataFrame:
    """The evictions (and evicted tokens) of steps >= `since_step`. A packed run's from the evictions per
    step of the chunks from that step on (carry.py); a run of the row layout's from its events.
    NOTE: the Overview reads it at every live refresh; decoding the window's events cost in proportion to
    the engine's event rate (the writer beside the dashboard paid for that CPU)."""
    if _has_chunks(capture, run_id):
        carried = capture.packed.carried(run_id, capture.schema_version, "evict_steps", (since_step, LAST_STEP))
        per_step = np.concatenate([read_evict_steps(bytes(b)) for b in carried.evict_steps] or [_NO_EVICT_STEPS])
        recent = per_step[per_step["step"] >= since_step]
        return pd.DataFrame(
            {"num_evictions": [int(recent["evictions"].sum())], "evicted_tokens": [int(recent["tokens"].sum())]}
        )
    ev = _all(capture, run_id, [EVICT], ["num_tokens"], (since_step, LAST_STEP))
    return pd.DataFrame({"num_evictions": [len(ev)], "evicted_tokens": [int(ev.num_tokens.sum())]})


# -- locks held ------------------------------------------------------------------------------

HELD_LOCK_COLUMNS = ("node_id", "rid", "since_step")
LOCKS = (EventKind.LOCK, EventKind.UNLOCK)
LOCK_FIELDS = ["step", "kind", "rid", "node_id", "aux", "reason"]
LOCK_STRINGS = ("kind", "rid", "reason")


def held_locks(capture: Capture, run_id: int, step: int) -> pd.DataFrame:
    """The locks held after `step`, in the order they were taken: node_id, rid (the holder: a request,
    a host-tier copy's "write|load <aux>", or None) and since_step, the step of the lock. An unlock
    releases the latest lock of the same holder on the same node; one with none held releases
    nothing (the slot ledger's rule). NOTE: a packed run's from its chunks' lock carries (carry.py),
    with events read only for the chunks that straddle `step`; a run of the row layout's from all its
    lock and unlock events up to `step`."""
    if not _has_chunks(capture, run_id):
        events = _all(capture, run_id, LOCKS, LOCK_FIELDS, (FIRST_STEP, step))
        texts: dict[str, int] = {}
        columns = _lock_columns(events, lambda values: _local_codes(values, texts))
        held = held_after([read_lock_carry(lock_carry(columns, 0, texts.get))])
        names = np.asarray([None, *texts], dtype=object)  # NOTE: local code c is names[c + 1]
        return _held_frame(held, lambda codes: names[codes + 1])
    chunks = capture.packed.carried(run_id, capture.schema_version, "lock_carry", (FIRST_STEP, step))
    partial = chunks[chunks.last_step > step]
    events = pd.DataFrame(columns=["seq", *LOCK_FIELDS])
    if len(partial):
        events = _all(
            capture, run_id, LOCKS, LOCK_FIELDS, (FIRST_STEP, step), LOCK_STRINGS, int(partial.first_seq.min()) - 1
        )
    carried = []
    for chunk in chunks.itertuples(index=False):
        if chunk.last_step <= step:
            carried.append(read_lock_carry(bytes(chunk.lock_carry)))
            continue
        first = int(chunk.first_seq)
        mine = events[(events.seq >= first) & (events.seq < first + int(chunk.num_events))]
        columns = _lock_columns(mine, np.asarray)
        carried.append(read_lock_carry(lock_carry(columns, first, lambda text: capture.packed.code_of(run_id, text))))
    return _held_frame(held_after(carried), lambda codes: decode_strings(capture, run_id, codes))


def _lock_columns(events: pd.DataFrame, codes: Callable[[pd.Series], np.ndarray]) -> dict[str, np.ndarray]:
    """Lock events as read (Capture.events) as lock_carry's columns; `codes` turns a string column
    into int codes."""
    columns = {name: events[name].to_numpy() for name in ("seq", "step", "aux")}
    columns.update({name: np.asarray(codes(events[name]), np.int64) for name in LOCK_STRINGS})
    node = events["node_id"]
    known = pd.notna(node).to_numpy()
    values = pd.to_numeric(node.where(known, 0)).to_numpy()
    columns["node_id"] = np.where(known, values.astype(np.int64), NULL_INT)
    return columns


def _local_codes(values: pd.Series, texts: dict[str, int]) -> np.ndarray:
    """Strings (NULL: None or NaN) as codes numbered in `texts` (NO_CODE for NULL)."""
    return np.fromiter(
        (NO_CODE if v is None or v != v else texts.setdefault(str(v), len(texts)) for v in values.tolist()),
        np.int64,
        len(values),
    )


def _held_frame(held: np.ndarray, decode: Callable[[np.ndarray], np.ndarray]) -> pd.DataFrame:
    """LOCK_CARRY_DTYPE records of held locks (in seq order) as held_locks' frame."""
    return pd.DataFrame(
        {
            "node_id": held["node"].astype(np.int64),
            "rid": pd.Series(holder_names(held["holder"].astype(np.int64), decode), dtype=object),
            "since_step": held["step"].astype(np.int64),
        }
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
