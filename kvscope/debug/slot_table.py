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
SMALL_MOVE = 16  # slots counted one by one below this; np.unique above
TO_FREE = -2  # NOTE: move_many's new owner of a slot a run of events left free (a request's ref is >= -1)


def distinct(slots: np.ndarray) -> np.ndarray:
    """Each slot once. NOTE: an event may list a slot twice (a buggy engine's allocation, or the
    SWA peers of two full slots that both pointed to one SWA slot); the pool writes such a slot
    once, so `Owners.move` must count it once."""
    if len(slots) > SMALL_MOVE:
        return np.unique(slots)
    return slots if len(set(slots.tolist())) == len(slots) else np.unique(slots)


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
        callers pass each slot once: see `distinct`)."""
        if len(old_kind) <= SMALL_MOVE:
            for k, r in zip(old_kind.tolist(), old_ref.tolist(), strict=True):
                if k != FREE:
                    self.held[k][r] -= 1
                    self.touched.add((k, r))
        else:
            self._release(old_kind, old_ref)
        if kind != FREE and len(old_kind):
            self.held[kind][ref] += len(old_kind)
            self.touched.add((kind, ref))

    def move_many(self, old_kind: np.ndarray, old_ref: np.ndarray, new_ref: np.ndarray, takers: np.ndarray) -> None:
        """Distinct slots went from (old_kind, old_ref) to a request (new_ref; -2: free) through a run
        of allocs and frees; `takers`: the requests that took slots on the way (they are touched,
        as `move` one event at a time would touch them, even when they gave the slots up again)."""
        self._release(old_kind, old_ref)
        values, counts = np.unique(new_ref[new_ref != TO_FREE], return_counts=True)
        held = self.held[REQUEST]
        for r, c in zip(values.tolist(), counts.tolist(), strict=True):
            held[r] += c
        self.touched.update((REQUEST, r) for r in set(takers.tolist()))

    def _release(self, old_kind: np.ndarray, old_ref: np.ndarray) -> None:
        """The owners (old_kind, old_ref) each lose their slots, counted per owner in one pass a kind."""
        for k, table in self.held.items():
            refs = old_ref[old_kind == k]
            if len(refs):
                values, counts = np.unique(refs, return_counts=True)
                for r, c in zip(values.tolist(), counts.tolist(), strict=True):
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

    def _fit(self, slots: np.ndarray) -> None:
        if len(slots) and int(slots.max()) >= len(self.kind):
            size = max(int(slots.max()) + 1, 2 * len(self.kind))
            for name, fill in self.FIELDS:
                old = getattr(self, name)
                new = np.full(size, fill, dtype=old.dtype)
                new[: len(old)] = old
                setattr(self, name, new)

    def assign(self, slots: np.ndarray, kind: int, ref: int, step: int, seq: int) -> None:
        slots = distinct(slots)
        self._fit(slots)
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
        order = np.lexsort((events, slots))
        s, e = slots[order], events[order]
        same = s[1:] == s[:-1]  # NOTE: s[i + 1] is the slot s[i] was
        if (same & (e[1:] == e[:-1])).any():
            return False
        self._fit(s[-1:])
        freeing = frees[e]
        was_free = self.kind[s] == FREE
        was_free[1:][same] = freeing[:-1][same]
        if (was_free & freeing).any():
            return False
        last = np.append(~same, True)
        first = np.insert(~same, 0, True)
        ends, by = s[last], e[last]
        new_ref = np.where(frees[by], TO_FREE, refs[by])
        takers = refs[~frees & (counts > 0)]
        self.owners.move_many(self.kind[s[first]], self.ref[s[first]], new_ref, takers)
        self.kind[ends] = np.where(frees[by], FREE, REQUEST)
        self.ref[ends] = np.where(frees[by], -1, refs[by])
        self.step[ends], self.seq[ends] = step, seqs[by]
        freed, freer = s[freeing], e[freeing]
        final = np.append(freed[1:] != freed[:-1], True)[: len(freed)]
        freed, freer = freed[final], freer[final]
        self.freed_by[freed], self.freed_step[freed], self.freed_seq[freed] = refs[freer], step, seqs[freer]
        return True

    def rename(self, slots: np.ndarray, kind: int, ref: int) -> None:
        """Slots of owner kind `kind` (TREE or HOST_COPY) move to node `ref` (a split), keeping
        their since step and event."""
        slots = distinct(slots)
        self.owners.move(self.kind[slots], self.ref[slots], kind, ref)
        self.ref[slots] = ref
