"""The ledger's storage: per pool, one row per slot (owner kind and reference, since when, the
last free), and per owner the slots it holds across pools.

NOTE: the per-step "is anything broken?" the onset needs must not scan the pools (a replay
asks it after every step). `Owners` keeps, per owner, how many slots it holds (all pools
together) and which owners got or lost slots, died or came back since the last question;
only those can have started or stopped holding orphans, so the answer costs O(owners
touched) instead of O(pool).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Container

import numpy as np

FREE, REQUEST, TREE, HOST_COPY = 0, 1, 2, 3  # owner kinds
OWNER_KINDS = (REQUEST, TREE, HOST_COPY)
# NOTE: a node owns its device slots (TREE) and its host copy (HOST_COPY, hiradix) apart: either
# may leave the tree while the other stays, so each kind has its own set of live references
SMALL_MOVE = 16  # slots counted one by one up to this; in array operations above
TO_FREE = -2  # NOTE: move_many's new owner of a slot a run of events left free (a request's ref is >= -1)


def tally(refs: np.ndarray) -> tuple[list[int], list[int]]:
    """The distinct values of `refs`, ascending, and how often each comes. NOTE: a step's owners
    are mostly recent requests (close indices): counted in a table over their span, no sort."""
    if not len(refs):
        return [], []
    lo, hi = int(refs.min()), int(refs.max())
    if hi - lo > 4 * len(refs) + 64:
        values, counts = np.unique(refs, return_counts=True)
        return values.tolist(), counts.tolist()
    table = np.bincount(refs - lo)
    present = np.flatnonzero(table)
    return (present + lo).tolist(), table[present].tolist()


class Owners:
    """Slots held per owner, across pools: requests by index, nodes (device slots) and host copies
    by node id. `touched` collects the
    owners that got or lost slots, died or came back since the last `orphaned_owners()`;
    `orphaned` holds the owners that are dead and hold slots."""

    def __init__(self) -> None:
        self.held: dict[int, defaultdict[int, int]] = {kind: defaultdict(int) for kind in OWNER_KINDS}
        self.touched: set[tuple[int, int]] = set()
        self.orphaned: set[tuple[int, int]] = set()

    def move(self, old_kind: np.ndarray, old_ref: np.ndarray, kind: int, ref: int) -> None:
        """Slots that were (old_kind, old_ref) now belong to (kind, ref); one entry per slot (the
        callers pass each slot once: see `PoolLedger.distinct`)."""
        if len(old_kind) <= SMALL_MOVE:
            for k, r in zip(old_kind.tolist(), old_ref.tolist(), strict=True):
                if k != FREE:
                    self.held[k][r] -= 1
                    self.touched.add((k, r))
        elif not self._release_one(old_kind, old_ref):
            self._release(old_kind, old_ref)
        if kind != FREE and len(old_kind):
            self.held[kind][ref] += len(old_kind)
            self.touched.add((kind, ref))

    def move_many(self, old_kind: np.ndarray, old_ref: np.ndarray, new_ref: np.ndarray, takers: np.ndarray) -> None:
        """Distinct slots went from (old_kind, old_ref) to a request (new_ref; -2: free) through a run
        of allocs and frees; `takers`: the requests that took slots on the way (they are touched,
        as `move` one event at a time would touch them, even when they gave the slots up again)."""
        self._release(old_kind, old_ref)
        held = self.held[REQUEST]
        for r, c in zip(*tally(new_ref[new_ref != TO_FREE]), strict=True):
            held[r] += c
        self.touched.update((REQUEST, r) for r in set(takers.tolist()))

    def _release_one(self, old_kind: np.ndarray, old_ref: np.ndarray) -> bool:
        """_release where every slot had one owner (the usual move: a request's slots into its node,
        a node's to its upper half); False, and nothing done, where they had several."""
        k, r = int(old_kind[0]), int(old_ref[0])
        if not ((old_kind == k).all() and (old_ref == r).all()):
            return False
        if k != FREE:
            self.held[k][r] -= len(old_kind)
            self.touched.add((k, r))
        return True

    def _release(self, old_kind: np.ndarray, old_ref: np.ndarray) -> None:
        """The owners (old_kind, old_ref) each lose their slots, counted per owner in one pass a kind."""
        for k, table in self.held.items():
            refs = old_ref[old_kind == k]
            if len(refs):
                for r, c in zip(*tally(refs), strict=True):
                    table[r] -= c
                    self.touched.add((k, r))

    def orphaned_owners(self, alive: dict[int, Container[int]]) -> set[tuple[int, int]]:
        """`alive`: per owner kind, the live references. Only a touched owner can have changed:
        it got or lost slots, died or came back."""
        for k, r in self.touched:
            if self.held[k][r] > 0 and r not in alive[k]:
                self.orphaned.add((k, r))
            else:
                self.orphaned.discard((k, r))
        self.touched = set()
        return self.orphaned


class PoolLedger:
    """Owner kind, owner reference (request index or node id), since step, since event seq;
    and per slot the last free: by which request, at which step and event."""

    FIELDS = (
        ("kind", 0),
        ("ref", -1),
        ("step", 0),
        ("seq", -1),
        ("freed_by", -1),
        ("freed_step", -1),
        ("freed_seq", -1),
    )

    def __init__(self, owners: Owners, num_slots: int = 1024) -> None:
        self.owners = owners
        self.kind = np.zeros(num_slots, dtype=np.int8)
        self.ref = np.full(num_slots, -1, dtype=np.int64)
        self.step = np.zeros(num_slots, dtype=np.int64)
        self.seq = np.full(num_slots, -1, dtype=np.int64)
        self.freed_by = np.full(num_slots, -1, dtype=np.int64)
        self.freed_step = np.full(num_slots, -1, dtype=np.int64)
        self.freed_seq = np.full(num_slots, -1, dtype=np.int64)
        self._mark = np.zeros(0, dtype=np.int32)  # scratch for `distinct`: no state, grown on demand

    def _fit(self, slots: np.ndarray) -> None:
        if len(slots) and int(slots.max()) >= len(self.kind):
            size = max(int(slots.max()) + 1, 2 * len(self.kind))
            for name, fill in self.FIELDS:
                old = getattr(self, name)
                new = np.full(size, fill, dtype=old.dtype)
                new[: len(old)] = old
                setattr(self, name, new)

    def distinct(self, slots: np.ndarray) -> np.ndarray:
        """Each slot once (`slots` fit the table). NOTE: an event may list a slot twice (a buggy
        engine's allocation, or the SWA peers of two full slots that both pointed to one SWA slot);
        the pool writes such a slot once, so `Owners.move` must count it once. Slots listed once
        each (the usual) come back as they are, found so without sorting: each writes its position
        in a scratch array, and a slot listed twice reads back its later position."""
        return slots if self._listed_once(slots) else np.unique(slots)

    def _listed_once(self, slots: np.ndarray) -> bool:
        """No slot twice in `slots` (which fit the table)."""
        if len(slots) <= SMALL_MOVE:
            return len(set(slots.tolist())) == len(slots)
        if len(self._mark) < len(self.kind):
            self._mark = np.zeros(len(self.kind), dtype=np.int32)
        positions = np.arange(len(slots), dtype=np.int32)
        self._mark[slots] = positions
        return bool((self._mark[slots] == positions).all())

    def assign(self, slots: np.ndarray, kind: int, ref: int, step: int, seq: int) -> None:
        self._fit(slots)
        slots = self.distinct(slots)
        self.owners.move(self.kind[slots], self.ref[slots], kind, ref)
        self.kind[slots], self.ref[slots], self.step[slots], self.seq[slots] = kind, ref, step, seq

    def free(self, slots: np.ndarray, step: int, seq: int, by: int) -> np.ndarray:
        """Mark free (by request index `by`, -1 for the tree); returns the slots that were
        free already (a double free)."""
        self._fit(slots)
        already = slots[self.kind[slots] == FREE]
        self.assign(slots, FREE, -1, step, seq)
        self.freed_by[slots], self.freed_step[slots], self.freed_seq[slots] = by, step, seq
        return already

    def take_and_free(
        self, step: int, seqs: np.ndarray, refs: np.ndarray, frees: np.ndarray, counts: np.ndarray, slots: np.ndarray
    ) -> bool:
        """The events of one step, in order, that each move their slots (`counts[i]` of `slots`) to
        request `refs[i]` (an alloc) or free them (`frees[i]`, by request `refs[i]`): what `assign`
        and `free` would do one event at a time, in a few array operations. Returns False, and
        changes nothing, where one at a time must decide: a slot twice in one event, or a double free.

        NOTE: sorted by (slot, event), each slot's occurrences are in event order: the state a slot
        has before an occurrence is the previous occurrence's (free or taken), or for its first the
        table's; its last occurrence is its state after the run."""
        if not len(slots):
            return True
        events = np.repeat(np.arange(len(seqs)), counts)
        self._fit(slots)
        if self._listed_once(slots):
            return self._take_and_free_once(step, seqs, refs, frees, counts, slots, events)
        order = np.lexsort((events, slots))
        s, e = slots[order], events[order]
        same = s[1:] == s[:-1]  # NOTE: s[i + 1] is the slot s[i] was
        if (same & (e[1:] == e[:-1])).any():
            return False
        freeing = frees[e]
        was_free = self.kind[s] == FREE
        was_free[1:][same] = freeing[:-1][same]
        if (was_free & freeing).any():
            return False
        last = np.concatenate([~same, [True]])
        first = np.concatenate([[True], ~same])
        ends, by = s[last], e[last]
        new_ref = np.where(frees[by], TO_FREE, refs[by])
        takers = refs[~frees & (counts > 0)]
        self.owners.move_many(self.kind[s[first]], self.ref[s[first]], new_ref, takers)
        self.kind[ends] = np.where(frees[by], FREE, REQUEST)
        self.ref[ends] = np.where(frees[by], -1, refs[by])
        self.step[ends], self.seq[ends] = step, seqs[by]
        freed, freer = s[freeing], e[freeing]
        final = np.concatenate([freed[1:] != freed[:-1], [True]])[: len(freed)]
        freed, freer = freed[final], freer[final]
        self.freed_by[freed], self.freed_step[freed], self.freed_seq[freed] = refs[freer], step, seqs[freer]
        return True

    def _take_and_free_once(
        self,
        step: int,
        seqs: np.ndarray,
        refs: np.ndarray,
        frees: np.ndarray,
        counts: np.ndarray,
        slots: np.ndarray,
        events: np.ndarray,
    ) -> bool:
        """take_and_free where no slot is listed twice in the run (the usual): each slot's one
        occurrence (event `events[i]`) is its state after the run, the table's its state before."""
        freeing = frees[events]
        old_kind = self.kind[slots]
        if (freeing & (old_kind == FREE)).any():
            return False
        by = refs[events]
        self.owners.move_many(old_kind, self.ref[slots], np.where(freeing, TO_FREE, by), refs[~frees & (counts > 0)])
        self.kind[slots] = np.where(freeing, FREE, REQUEST)
        self.ref[slots] = np.where(freeing, -1, by)
        self.step[slots], self.seq[slots] = step, seqs[events]
        freed, freer = slots[freeing], events[freeing]
        self.freed_by[freed], self.freed_step[freed], self.freed_seq[freed] = refs[freer], step, seqs[freer]
        return True

    def rename(self, slots: np.ndarray, kind: int, ref: int) -> None:
        """Slots of owner kind `kind` (TREE or HOST_COPY) move to node `ref` (a split), keeping
        their since step and event."""
        slots = self.distinct(slots)
        self.owners.move(self.kind[slots], self.ref[slots], kind, ref)
        self.ref[slots] = ref
