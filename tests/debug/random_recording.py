"""Seeded random recordings for the leak report's before/after comparison (test_report_before_after).

A recording is a small `full` capture written through a real SQLRecorder: requests are admitted,
allocate slots (full; SWA halves; host copies), insert them as nodes, split, evict, lock and unlock,
and end; a share of the events is wrong on purpose (a slot taken from anywhere, a free of slots
nobody held, a request that ends holding slots, a lock never released, a copy never acknowledged,
a read of freed slots), so reports have leaks, double frees, stuck copies and culprits. Half the
seeds use long slot lists (past slot_table.SMALL_MOVE) so the replay's array paths run.

    python -m tests.debug.random_recording OUT.json   # the reports of REPORT_SEEDS with this tree's code
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvscope.telemetry import CopyKind, EventKind, EvictReason, LeakCheck, PoolName, RequestRecord
from kvscope.telemetry.recorder import SQLRecorder

REPORT_SEEDS = range(40)
VARYING_FIELDS = ("capture", "stored_at")  # the file's name and when it was read back: not the report's content


class _Recording:
    """The state a recording keeps so that most of its events are consistent."""

    def __init__(self, rec: SQLRecorder, rng: random.Random, long_lists: bool) -> None:
        self.rec, self.rng = rec, rng
        self.max_take = 60 if long_lists else 6
        universe = 2_000 if long_lists else 80
        self.free = {"full": list(range(1, universe)), "swa": list(range(1, universe)), "host": list(range(universe))}
        self.universe = universe
        self.held: dict[str, list[int]] = {}  # rid -> its full slots
        self.live: list[str] = []
        self.nodes: dict[int, list[int]] = {}  # node id -> its full slots
        self.host: dict[int, list[int]] = {}  # node id -> its host copy
        self.locks: list[tuple[int, str]] = []
        self.ops: list[int] = []  # copy ops in flight
        self.next_rid, self.next_node, self.next_op = 0, 1, 1
        self.ended: list[str] = []

    def take(self, pool: str, num_slots: int) -> list[int]:
        if self.rng.random() < 0.04:  # NOTE: wrong on purpose: slots from anywhere (may be held)
            return [self.rng.randrange(self.universe) for _ in range(num_slots)]
        free = self.free[pool]
        taken, self.free[pool] = free[:num_slots], free[num_slots:]
        return taken

    def give_back(self, pool: str, slots: list[int]) -> None:
        self.free[pool].extend(slots)
        self.rng.shuffle(self.free[pool])

    def event(self, kind: EventKind, **fields: Any) -> None:
        if "slots" in fields:
            fields["slots"] = np.asarray(fields["slots"], np.int64)
        self.rec.record(kind, **fields)

    def step(self) -> None:
        rng = self.rng
        for _ in range(rng.randint(1, 3)):
            self.admit()
        for rid in list(self.live):
            self.decode(rid)
        for _ in range(rng.randint(0, 3)):
            getattr(self, rng.choice(["finish", "finish", "evict", "split", "copy", "wrong_free", "read"]))()
        if rng.random() < 0.3:
            self.ack()

    def admit(self) -> None:
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        self.event(EventKind.REQUEST_ARRIVE, rid=rid, num_tokens=5)
        self.event(EventKind.REQUEST_ADMIT, rid=rid, num_tokens=5)
        if self.nodes and self.rng.random() < 0.6:
            node = self.rng.choice(list(self.nodes))
            self.event(EventKind.MATCH, pool=PoolName.FULL, rid=rid, node_id=node, num_tokens=len(self.nodes[node]))
            self.event(EventKind.LOCK, rid=rid, node_id=node, num_tokens=len(self.nodes[node]))
            self.locks.append((node, rid))
        slots = self.take("full", self.rng.randint(1, self.max_take))
        self.event(EventKind.ALLOC, pool=PoolName.FULL, rid=rid, num_tokens=len(slots), slots=slots)
        if self.rng.random() < 0.3:  # a sliding-window half: its SWA slots pair with these
            swa = self.take("swa", len(slots))
            self.event(EventKind.ALLOC, pool=PoolName.SWA, rid=rid, num_tokens=len(swa), slots=swa)
        self.held[rid] = list(slots)
        self.live.append(rid)

    def decode(self, rid: str) -> None:
        slots = self.take("full", 1)
        self.event(EventKind.ALLOC, pool=PoolName.FULL, rid=rid, num_tokens=1, slots=slots)
        self.held[rid] += slots

    def finish(self) -> None:
        if not self.live:
            return
        rid = self.live.pop(self.rng.randrange(len(self.live)))
        slots = self.held.pop(rid)
        roll = self.rng.random()
        if roll < 0.6 and slots:  # into the tree
            node = self.next_node
            self.next_node += 1
            self.event(EventKind.INSERT, pool=PoolName.FULL, rid=rid, node_id=node, num_tokens=len(slots), slots=slots)
            self.nodes[node] = slots
        elif roll < 0.9:  # freed
            self.event(EventKind.FREE, pool=PoolName.FULL, rid=rid, num_tokens=len(slots), slots=slots)
            self.give_back("full", slots)
        # else: NOTE: wrong on purpose: the request ends holding its slots
        for lock in [lock for lock in self.locks if lock[1] == rid]:
            if self.rng.random() < 0.9:  # NOTE: else a lock never released
                self.event(EventKind.UNLOCK, rid=rid, node_id=lock[0])
            self.locks.remove(lock)
        kind = self.rng.choice([EventKind.REQUEST_FINISH] * 4 + [EventKind.REQUEST_ABORT, EventKind.REQUEST_RETRACT])
        self.event(kind, rid=rid, num_tokens=len(slots))
        self.ended.append(rid)

    def evict(self) -> None:
        if not self.nodes:
            return
        node = self.rng.choice(list(self.nodes))
        slots = self.nodes[node]
        part = slots if self.rng.random() < 0.7 else slots[: max(1, len(slots) // 2)]
        self.event(EventKind.EVICT, pool=PoolName.FULL, node_id=node, num_tokens=len(part), slots=part,
                   reason=EvictReason.CAPACITY)  # fmt: skip
        if self.rng.random() < 0.92:  # NOTE: else the evicted slots are never freed
            self.event(EventKind.FREE, pool=PoolName.FULL, num_tokens=len(part), slots=part)
            self.give_back("full", part)
        rest = [s for s in slots if s not in set(part)]
        if rest:
            self.nodes[node] = rest
        else:
            del self.nodes[node]

    def split(self) -> None:
        long = [node for node, slots in self.nodes.items() if len(slots) > 1]
        if not long:
            return
        child = self.rng.choice(long)
        upper_len = self.rng.randrange(1, len(self.nodes[child]))
        node = self.next_node
        self.next_node += 1
        self.event(EventKind.SPLIT, pool=PoolName.FULL, node_id=node, num_tokens=upper_len, aux=child)
        self.nodes[node], self.nodes[child] = self.nodes[child][:upper_len], self.nodes[child][upper_len:]
        if child in self.host:
            self.host[node], self.host[child] = self.host[child][:upper_len], self.host[child][upper_len:]

    def copy(self) -> None:
        """A write-back of a node to the host tier, its lock held by the copy op until the ack."""
        if not self.nodes:
            return
        node = self.rng.choice(list(self.nodes))
        op = self.next_op
        self.next_op += 1
        host = self.take("host", len(self.nodes[node]))
        self.event(EventKind.ALLOC, pool=PoolName.HOST, num_tokens=len(host), slots=host)
        self.event(EventKind.WRITE, pool=PoolName.HOST, node_id=node, num_tokens=len(host), slots=host, aux=op)
        self.event(EventKind.LOCK, node_id=node, aux=op, reason=CopyKind.WRITE)
        self.host[node] = host
        self.ops.append(op)

    def ack(self) -> None:
        if not self.ops:
            return
        op = self.ops.pop(0)
        self.event(EventKind.ACK, aux=op, reason=CopyKind.WRITE)
        node = next((n for n in self.host if n in self.nodes), None)
        self.event(EventKind.UNLOCK, node_id=node, aux=op, reason=CopyKind.WRITE)
        if node is not None and self.rng.random() < 0.5:
            host = self.host.pop(node)
            self.event(EventKind.HOST_EVICT, pool=PoolName.HOST, node_id=node, num_tokens=len(host))
            if self.rng.random() < 0.9:
                self.event(EventKind.FREE, pool=PoolName.HOST, num_tokens=len(host), slots=host)
                self.give_back("host", host)

    def wrong_free(self) -> None:
        """NOTE: wrong on purpose: frees slots whoever holds them (a double free when they were free)."""
        slots = [self.rng.randrange(1, self.universe) for _ in range(self.rng.randint(1, self.max_take))]
        rid = self.rng.choice(self.live) if self.live else None
        self.event(EventKind.FREE, pool=PoolName.FULL, rid=rid, num_tokens=len(slots), slots=slots)

    def read(self) -> None:
        """A request reads slots it may not hold (a use after free when they were freed)."""
        if not self.live:
            return
        slots = [self.rng.randrange(1, self.universe) for _ in range(3)]
        self.event(EventKind.VIOLATION, pool=PoolName.FULL, rid=self.rng.choice(self.live), num_tokens=3,
                   slots=slots, aux=1)  # fmt: skip


def record_random(path: Path, seed: int) -> None:
    """A random recording (see the module docstring) at `path`; the same seed, the same events."""
    rng = random.Random(seed)
    with SQLRecorder(path, level="full", label=f"random-{seed}") as rec:
        recording = _Recording(rec, rng, long_lists=seed % 2 == 1)
        num_steps = rng.randint(4, 30)
        for step in range(num_steps):
            rec.step = step
            recording.step()
            if step % 4 == 3 or step == num_steps - 1:
                rec.record(EventKind.LEAK_CHECK)
                rec.leak_check(LeakCheck(step, "full", 100, 60, 20, 20, 0, 0, True))
        for i in range(recording.next_rid):
            rid = f"r{i}"
            status = "finished" if rid in recording.ended else "running"
            rec.request(RequestRecord(rid, f"u{i % 3}", 5, status, 0, 1, 0, {}, {"arrive": 0, "finish": num_steps}))


def report_fields(report: Any) -> dict[str, Any]:
    """A report as plain JSON values, without VARYING_FIELDS."""
    fields = json.loads(json.dumps(dataclasses.asdict(report), default=int))
    return {name: value for name, value in fields.items() if name not in VARYING_FIELDS}


def main() -> None:
    from kvscope.debug.report import build_report

    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in REPORT_SEEDS:
            path = Path(tmp) / f"random-{seed}.db"
            record_random(path, seed)
            reports[str(seed)] = report_fields(build_report(path))
    Path(sys.argv[1]).write_text(json.dumps(reports, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
