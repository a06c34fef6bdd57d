"""The slot-ownership ledger: for every slot of every pool (full, swa, host), who holds it
now (free, a request, a tree node, a node's host copy), since which step, through which event.

It is fed the event stream, so the same code runs live (the debug monitor wraps the
recorder) and after the fact (replaying a `full` capture).

NOTE: what each event does to the ledger
    alloc   pool's slots -> the request (a SWA alloc right after the same request's full
            alloc of as many slots pairs them: that is how the SWA half is followed; a host
            alloc has rid None and its write follows at once)
    free    slots -> free; a slot that was already free is a double free (any pool); a SWA
            slot freed (out of the window, tombstoned, evicted) is no full slot's peer any more
    insert  full slots (and their SWA peers) -> the new node
    split   the first num_tokens slots of node `aux` -> the new upper node, on both tiers: its
            device slots (none for a host-only node) and its host copy
    revive  the node's full slots (and SWA peers) -> the node (hiradix: a load or an adoption
            gives a host-only node device slots again)
    evict   the slots leave their node (the allocator's free follows); hiradix to-host: only
            the device slots leave, the node's host copy stays in the tree
    write   host slots -> the node's host copy (owner kind HOST_COPY); op `aux` is in flight
    load    op `aux` is in flight (the device slots come with the revives that follow)
    ack     op `aux` ends
    host_evict      the node's host copy leaves the tree (the host free follows)
    leak_check      an idle point: every copy op must have been acknowledged by now
    lock / unlock   a request's lock: (node, rid) pairs; a copy lock (reason a CopyKind, rid
            None): (node, op aux), legitimate only while that op is in flight. apply() turns a
            lock's aux into that op id, or 0 for a request's lock (whose aux counts SWA tokens)
    admit / finish / abort / retract   request liveness
    violation       a read of slots the reader did not hold: the last freer is the culprit
IGNORED_KINDS lists the kinds that move no slot and change no liveness; every kind is either
handled or listed there (a test checks).
An orphan is a slot held by a request that is no longer live, by a node that is gone, or by a
host copy that left the tree. A defect is an orphan, a double free, a lock held by an ended
request or by a copy op that was acknowledged, or a copy op in flight at an idle point.

The per-slot arrays and the per-owner counts live in slot_table.py.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvscope.debug.slot_table import FREE, HOST_COPY, REQUEST, TREE, Owners, PoolLedger
from kvscope.telemetry import CopyKind, EventKind

POOLS = ("full", "swa", "host")
IGNORED_KINDS = frozenset(
    {
        EventKind.REQUEST_ARRIVE,  # a request holds nothing and is not live before its admit
        EventKind.MATCH,  # a read of the tree: no slot changes hands
        EventKind.TOMBSTONE,  # the SWA free events that follow move the slots
        EventKind.INJECT,  # the ground truth of an injected fault, for tests; its effects come as events
        EventKind.PROMOTE,  # scoped radix: who may see a node changes, not who holds its slots
        EventKind.DEMOTE,  # scoped radix: the TOMBSTONE, EVICT and FREE events that follow move the slots
        EventKind.CROSS_HIT,  # scoped radix: part of a match, read only
        EventKind.NO_ROOM,  # the vLLM probe: an allocation that found no room; nothing was taken
    }
)
LOCK_KINDS = frozenset({EventKind.LOCK, EventKind.UNLOCK})
COPY_KINDS = frozenset(k.value for k in CopyKind)  # a lock event's reason when a copy op holds it
Handler = Callable[[int, int, str, str | None, Any, int, int, np.ndarray], None]
NO_SLOTS = np.empty(0, dtype=np.int64)  # an event without slots (shared: never written to)
NO_SLOTS.flags.writeable = False


class Holding(NamedTuple):
    """Slots one owner holds, and the event that gave them (the earliest); `owner` is its kind
    (REQUEST, TREE or HOST_COPY), `gone_step` when a node or host copy left the tree."""

    pool: str
    slots: list[int]
    rid: str | None
    node_id: int | None
    step: int
    seq: int
    owner: int = REQUEST
    gone_step: int | None = None


class DoubleFree(NamedTuple):
    pool: str
    slots: list[int]
    rid: str | None
    step: int
    seq: int
    first_step: int
    first_seq: int


class HeldLock(NamedTuple):
    node_id: int
    rid: str | None
    step: int
    seq: int
    op: int = 0  # the copy op holding it (hiradix), 0: request rid's lock


class CopyOp(NamedTuple):
    """A hiradix copy in flight: a write (device -> host) or a load (host -> device)."""

    kind: str
    node_id: int | None
    step: int
    seq: int
    num_tokens: int


class StuckOp(NamedTuple):
    """A copy op still in flight at an idle point (idle_step), where every op is acknowledged."""

    op: int
    copy: CopyOp
    idle_step: int
    idle_seq: int


class BadRead(NamedTuple):
    """A request read slots it did not hold; the culprit is whoever freed them last."""

    reader: str | None
    slots: list[int]
    step: int
    seq: int
    position: int
    freer: str | None
    free_step: int
    free_seq: int


@dataclass
class Ledger:
    owners: Owners = field(default_factory=Owners)
    pools: dict[str, PoolLedger] = field(default_factory=dict)
    rids: list[str] = field(default_factory=list)
    rid_index: dict[str, int] = field(default_factory=dict)
    live: set[int] = field(default_factory=set)
    ended: dict[int, tuple[str, int]] = field(default_factory=dict)  # request -> (how, step)
    node_slots: dict[int, np.ndarray] = field(default_factory=dict)
    host_copies: dict[int, np.ndarray] = field(default_factory=dict)  # node id -> its host slots
    gone: dict[tuple[int, int], int] = field(default_factory=dict)  # (TREE | HOST_COPY, node) -> step it left
    in_flight: dict[int, CopyOp] = field(default_factory=dict)  # op id -> the copy
    stuck_ops: list[StuckOp] = field(default_factory=list)
    full_to_swa: dict[int, int] = field(default_factory=dict)  # full slot -> its SWA peer (see _pair)
    swa_to_full: dict[int, int] = field(default_factory=dict)  # the inverse: one full slot per SWA slot
    locks: list[HeldLock] = field(default_factory=list)
    double_frees: list[DoubleFree] = field(default_factory=list)
    bad_reads: list[BadRead] = field(default_factory=list)
    last_seq: int = -1  # the last event applied
    # NOTE: a batched SWA allocation records full r1, full r2, ..., then swa r1, swa r2, ...;
    # the full halves wait here until their SWA halves pair with them (cleared by any other event).
    # A replay's run of full allocs joins them unlisted (_pending_run: its rids, the slots' ends,
    # counts and slots, from which index) until a SWA alloc or a checkpoint reads them (pending())
    _pending_full: list[tuple[str | None, np.ndarray]] = field(default_factory=list)
    _pending_run: tuple[list[str | None], np.ndarray, np.ndarray, np.ndarray, int] | None = None

    def __post_init__(self) -> None:
        self.pools = {p: PoolLedger(self.owners) for p in POOLS}
        self._handlers: dict[EventKind, Handler] = {
            EventKind.ALLOC: self._on_alloc,
            EventKind.FREE: self._on_free,
            EventKind.INSERT: self._on_insert,
            EventKind.SPLIT: self._on_split,
            EventKind.REVIVE: self._on_revive,
            EventKind.EVICT: self._on_evict,
            EventKind.LOCK: self._on_lock,
            EventKind.UNLOCK: self._on_unlock,
            EventKind.VIOLATION: self._on_violation,
            EventKind.REQUEST_ADMIT: self._on_admit,
            EventKind.REQUEST_FINISH: self._on_finish,
            EventKind.REQUEST_ABORT: self._on_abort,
            EventKind.REQUEST_RETRACT: self._on_retract,
            EventKind.WRITE: self._on_write,
            EventKind.LOAD: self._on_load,
            EventKind.ACK: self._on_ack,
            EventKind.HOST_EVICT: self._on_host_evict,
            EventKind.LEAK_CHECK: self._on_leak_check,
        }

    def request_index(self, rid: str) -> int:
        if rid not in self.rid_index:
            self.rid_index[rid] = len(self.rids)
            self.rids.append(rid)
        return self.rid_index[rid]

    # -- events ------------------------------------------------------------------------------

    def apply(
        self,
        kind: EventKind,
        step: int,
        seq: int,
        pool: str | None,
        rid: str | None,
        node_id: int | None,
        num_tokens: int,
        aux: int,
        slots: np.ndarray | None,
        reason: str | None = None,
    ) -> None:
        """One event. NOTE: the parameters after `kind` are named after schema.events columns
        (APPLY_COLUMNS): a replay selects exactly those, in this order."""
        self.last_seq = seq
        if kind in LOCK_KINDS and reason not in COPY_KINDS:
            aux = 0  # a request's lock (see the NOTE above)
        if kind != EventKind.ALLOC:
            self._pending_full.clear()
            self._pending_run = None
        handler = self._handlers.get(kind)
        if handler is not None:
            handler(
                step,
                seq,
                pool or "full",
                rid,
                node_id,
                num_tokens,
                aux,
                NO_SLOTS if slots is None else np.asarray(slots, dtype=np.int64),
            )

    def apply_takes_and_frees(
        self,
        step: int,
        pool: str,
        seqs: np.ndarray,
        frees: np.ndarray,
        rids: list[str | None],
        counts: np.ndarray,
        slots: np.ndarray,
    ) -> None:
        """Consecutive alloc (`frees[i]` False) and free events of one step in one pool, not swa (its
        frees unpair SWA peers, its allocs pair them): the same ledger as apply() on each in turn, in
        a few array operations (a replay's bulk). Event i has `counts[i]` of `slots` (NO_SLOTS, -1:
        none)."""
        if not len(seqs):
            return
        table, counts = self.pools[pool], np.maximum(counts, 0)
        index = self.rid_index
        refs = np.fromiter(
            (-1 if r is None else index[r] if r in index else self.request_index(r) for r in rids), np.int64, len(rids)
        )
        if not table.take_and_free(step, seqs, refs, frees, counts, slots):
            ends = np.cumsum(counts)
            for i, (seq, free) in enumerate(zip(seqs.tolist(), frees.tolist(), strict=True)):
                kind = EventKind.FREE if free else EventKind.ALLOC
                self.apply(kind, step, seq, pool, rids[i], None, 0, 0, slots[ends[i] - counts[i] : ends[i]])
            return
        self.last_seq = int(seqs[-1])
        self._pend_after(pool, frees, rids, counts, slots)

    def _pend_after(
        self, pool: str, frees: np.ndarray, rids: list[str | None], counts: np.ndarray, slots: np.ndarray
    ) -> None:
        """_pending_full as apply() one event at a time leaves it: a free clears it, a full alloc joins it."""
        freed_at = np.flatnonzero(frees)
        start = int(freed_at[-1]) + 1 if len(freed_at) else 0
        if start:
            self._pending_full.clear()
            self._pending_run = None
        if pool != "full" or start == len(rids):
            return
        self.pending()  # NOTE: an earlier run still unlisted goes first
        self._pending_run = (rids, np.cumsum(counts), counts, slots, start)

    def pending(self) -> list[tuple[str | None, np.ndarray]]:
        """The full allocs waiting for their SWA halves (see _pending_full), in event order."""
        if self._pending_run is not None:
            rids, ends, counts, slots, start = self._pending_run
            self._pending_run = None
            for i in range(start, len(rids)):
                self._pending_full.append((rids[i], slots[ends[i] - counts[i] : ends[i]]))
        return self._pending_full

    def _on_alloc(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        ref = self.request_index(rid) if rid is not None else -1
        self.pools[pool].assign(slots, REQUEST, ref, step, seq)
        if pool == "full":
            self.pending().append((rid, slots))
            return
        if pool != "swa":
            return
        for i, (full_rid, full) in enumerate(self.pending()):
            if full_rid == rid and len(full) == len(slots):
                self._pair(full, slots)
                del self._pending_full[i]
                return

    def _on_free(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        if pool == "swa":
            self._unpair(slots.tolist())
        ledger = self.pools[pool]
        ledger._fit(slots)
        first_step, first_seq = ledger.step[slots].copy(), ledger.seq[slots].copy()
        twice = ledger.free(slots, step, seq, self.request_index(rid) if rid is not None else -1)
        if len(twice):
            where = np.isin(slots, twice)
            self.double_frees.append(
                DoubleFree(pool, twice.tolist(), rid, step, seq, int(first_step[where][0]), int(first_seq[where][0]))
            )

    def _tree(self, slots: np.ndarray, node_id: int, step: int, seq: int) -> None:
        self.pools["full"].assign(slots, TREE, node_id, step, seq)
        swa = self._swa_of(slots)
        if len(swa):
            ledger = self.pools["swa"]
            ledger._fit(swa)
            ledger.assign(swa[ledger.kind[swa] != FREE], TREE, node_id, step, seq)  # tombstoned halves stay free

    def _node_alive(self, node_id: int, slots: np.ndarray) -> None:
        self.node_slots[node_id] = slots
        self.gone.pop((TREE, node_id), None)
        self.owners.touched.add((TREE, node_id))

    def _host_alive(self, node_id: int, slots: np.ndarray) -> None:
        self.host_copies[node_id] = slots
        self.gone.pop((HOST_COPY, node_id), None)
        self.owners.touched.add((HOST_COPY, node_id))

    def _on_insert(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        self._node_alive(int(node_id), slots)
        self._tree(slots, int(node_id), step, seq)

    def _on_revive(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        """pool full: the node's (maybe adopted) full slots; pool swa: the SWA slots now behind them."""
        if pool == "full":
            self._node_alive(int(node_id), slots)
            self.pools["full"].assign(slots, TREE, int(node_id), step, seq)
            return
        full = self.node_slots.get(int(node_id))
        if full is not None and len(full) == len(slots):
            self._pair(full, slots)
        self.pools["swa"].assign(slots[slots > 0], TREE, int(node_id), step, seq)

    def _on_split(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        child, host = self.node_slots.get(aux), self.host_copies.get(aux)
        if child is not None:
            upper, self.node_slots[aux] = child[:n], child[n:]
            self._node_alive(int(node_id), upper)
            for name, moved in (("full", upper), ("swa", self._swa_of(upper))):
                self._rename(name, moved, TREE, aux, int(node_id))
        if host is not None:
            upper, self.host_copies[aux] = host[:n], host[n:]
            self._host_alive(int(node_id), upper)
            self._rename("host", upper, HOST_COPY, aux, int(node_id))

    def _rename(self, pool: str, moved: np.ndarray, kind: int, old: int, new: int) -> None:
        ledger = self.pools[pool]
        ledger._fit(moved)
        ledger.rename(moved[(ledger.kind[moved] == kind) & (ledger.ref[moved] == old)], kind, new)

    def _pair(self, full: np.ndarray, swa: np.ndarray) -> None:
        """These SWA slots are now behind these full slots (0: none behind it). NOTE: as in the
        allocator's mapping, a SWA slot is behind one full slot at a time and a freed one behind
        none: a stale peer would hand an insert of its old full slot the SWA slot of whoever
        holds it now, and two full slots of one event could reach it twice."""
        for full_slot, swa_slot in zip(full.tolist(), swa.tolist(), strict=True):
            self._unpair([self.full_to_swa.get(full_slot, 0), swa_slot])
            if swa_slot > 0:
                self.full_to_swa[full_slot], self.swa_to_full[swa_slot] = swa_slot, full_slot

    def _unpair(self, swa_slots: list[int]) -> None:
        """These SWA slots are behind no full slot any more (freed, or behind another one now)."""
        for swa_slot in swa_slots:
            full_slot = self.swa_to_full.pop(swa_slot, None)
            if full_slot is not None:
                del self.full_to_swa[full_slot]

    def _swa_of(self, full_slots: np.ndarray) -> np.ndarray:
        if not self.full_to_swa:
            return NO_SLOTS
        return np.array([self.full_to_swa[s] for s in full_slots.tolist() if s in self.full_to_swa], dtype=np.int64)

    def _on_evict(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        held = self.node_slots.get(int(node_id))
        if held is None:
            return
        whole = len(held) == len(slots) and np.array_equal(held, slots)  # NOTE: the usual eviction
        rest = held[:0] if whole else held[~np.isin(held, slots)]
        if len(rest):
            self.node_slots[int(node_id)] = rest
        else:
            del self.node_slots[int(node_id)]
            self.gone[(TREE, int(node_id))] = step
            self.owners.touched.add((TREE, int(node_id)))

    def _on_write(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        if node_id is None:
            return
        self._host_alive(int(node_id), slots)
        self.pools["host"].assign(slots, HOST_COPY, int(node_id), step, seq)
        self.in_flight[aux] = CopyOp("write", int(node_id), step, seq, n)

    def _on_load(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        self.in_flight[aux] = CopyOp("load", None if node_id is None else int(node_id), step, seq, n)

    def _on_ack(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        self.in_flight.pop(aux, None)

    def _on_host_evict(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        if node_id is not None and self.host_copies.pop(int(node_id), None) is not None:
            self.gone[(HOST_COPY, int(node_id))] = step
            self.owners.touched.add((HOST_COPY, int(node_id)))

    def _on_leak_check(self, step: int, seq: int, *_: Any) -> None:
        """An idle point: the engine drained every copy before its leak check."""
        stuck = {s.op for s in self.stuck_ops}
        self.stuck_ops += [StuckOp(op, copy, step, seq) for op, copy in self.in_flight.items() if op not in stuck]

    def _on_violation(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        ledger = self.pools["full"]
        ledger._fit(slots)
        last = slots[np.argmax(ledger.freed_seq[slots])] if len(slots) else 0
        by = int(ledger.freed_by[last])
        self.bad_reads.append(
            BadRead(
                rid,
                slots.tolist(),
                step,
                seq,
                aux,
                self.rids[by] if by >= 0 else None,
                int(ledger.freed_step[last]),
                int(ledger.freed_seq[last]),
            )
        )

    def _on_lock(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        if node_id is not None:
            self.locks.append(HeldLock(int(node_id), rid, step, seq, aux))

    def _on_unlock(
        self, step: int, seq: int, pool: str, rid: str | None, node_id: Any, n: int, aux: int, slots: np.ndarray
    ) -> None:
        for i in range(len(self.locks) - 1, -1, -1):
            held = self.locks[i]
            if held.node_id == node_id and held.rid == rid and held.op == aux:
                del self.locks[i]
                return

    def _on_admit(self, step: int, seq: int, pool: str, rid: str | None, *_: Any) -> None:
        if rid is not None:
            index = self.request_index(rid)
            self.live.add(index)
            self.ended.pop(index, None)
            self.owners.touched.add((REQUEST, index))

    def _end(self, how: str, step: int, rid: str | None) -> None:
        if rid is not None:
            index = self.request_index(rid)
            self.live.discard(index)
            self.ended[index] = (how, step)
            self.owners.touched.add((REQUEST, index))

    def _on_finish(self, step: int, seq: int, pool: str, rid: str | None, *_: Any) -> None:
        self._end("finished", step, rid)

    def _on_abort(self, step: int, seq: int, pool: str, rid: str | None, *_: Any) -> None:
        self._end("aborted", step, rid)

    def _on_retract(self, step: int, seq: int, pool: str, rid: str | None, *_: Any) -> None:
        self._end("retracted", step, rid)

    # -- questions ---------------------------------------------------------------------------

    def alive(self) -> dict[int, Any]:
        """Per owner kind, the references that are live now (the test of an orphan)."""
        return {REQUEST: self.live, TREE: self.node_slots, HOST_COPY: self.host_copies}

    def orphans(self) -> list[Holding]:
        """Slots held by requests that ended, by nodes no longer in the tree, or by host copies
        that left it; one entry per owner."""
        found: list[Holding] = []
        for name, ledger in self.pools.items():
            for owner, alive in self.alive().items():
                slots = np.flatnonzero((ledger.kind == owner) & ~np.isin(ledger.ref, list(alive)))
                slots = slots[np.argsort(ledger.ref[slots], kind="stable")]  # grouped by owner, slots ascending
                refs = ledger.ref[slots]
                for group in np.split(slots, np.flatnonzero(refs[1:] != refs[:-1]) + 1) if len(slots) else []:
                    found.append(self._holding(name, ledger, owner, group))
        return found

    def _holding(self, pool: str, ledger: PoolLedger, owner: int, group: np.ndarray) -> Holding:
        ref = int(ledger.ref[group[0]])
        first = group[np.argmin(ledger.seq[group])]
        is_request = owner == REQUEST
        rid = self.rids[ref] if is_request and ref >= 0 else None
        return Holding(
            pool,
            group.tolist(),
            rid,
            None if is_request else ref,
            int(ledger.step[first]),
            int(ledger.seq[first]),
            owner,
            None if is_request else self.gone.get((owner, ref)),
        )

    def locks_of_ended_requests(self) -> list[HeldLock]:
        """Locks nobody may hold now: a request's (op 0) once it ended, a copy op's once that op
        is no longer in flight."""
        return [
            h
            for h in self.locks
            if (h.op not in self.in_flight if h.op else h.rid is None or self.rid_index.get(h.rid, -1) not in self.live)
        ]

    def is_broken(self) -> bool:
        """Any double free, lock nobody may hold, copy op stuck at an idle point, or orphaned slot
        now; costs what changed since the last call, not a scan of the pools (equals
        `bool(orphans())` etc.)."""
        orphaned = self.orphaned_owners()  # always: it also empties the touched set
        return bool(self.double_frees or self.stuck_ops or orphaned or self.locks_of_ended_requests())

    def orphaned_owners(self) -> set[tuple[int, int]]:
        """(REQUEST, request index), (TREE, node id) and (HOST_COPY, node id) of the owners
        holding orphans now."""
        return self.owners.orphaned_owners(self.alive())

    def check_integrity(self) -> None:
        """The per-owner held counts equal a recount of every pool; each SWA slot is the peer of
        one full slot at most."""
        recount: dict[int, defaultdict[int, int]] = {kind: defaultdict(int) for kind in self.owners.held}
        for ledger in self.pools.values():
            for kind, table in recount.items():
                refs, counts = np.unique(ledger.ref[ledger.kind == kind], return_counts=True)
                for ref, count in zip(refs.tolist(), counts.tolist(), strict=True):
                    table[ref] += count
        if {swa: full for full, swa in self.full_to_swa.items()} != self.swa_to_full:
            raise AssertionError(f"SWA peers not one to one: {self.full_to_swa} vs {self.swa_to_full}")
        names = {REQUEST: "request", TREE: "node", HOST_COPY: "host copy"}
        for kind, table in recount.items():
            kept = {ref: n for ref, n in self.owners.held[kind].items() if n}
            if kept != dict(table):
                raise AssertionError(f"ledger held counts ({names[kind]}) drifted: kept {kept}, recount {dict(table)}")

    def read_violations(self, rid: str, slots: np.ndarray) -> np.ndarray:
        """Slots a request is about to read that it may not: free, or another live request's."""
        ledger = self.pools["full"]
        ledger._fit(slots)
        own = self.rid_index.get(rid, -2)
        kind, ref = ledger.kind[slots], ledger.ref[slots]
        return slots[(kind == FREE) | ((kind == REQUEST) & (ref != own))]


APPLY_COLUMNS = tuple(inspect.signature(Ledger.apply).parameters)[1:]  # kind, step, seq, ..., slots
