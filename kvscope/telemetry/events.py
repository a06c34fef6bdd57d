"""Event kinds and the recorder interface every layer reports to (no SQL here).

NOTE: one event = (kind, pool, rid, node_id, num_tokens, slots, reason, aux, principal):
    match      num_tokens = hit tokens, aux = miss tokens, node_id = last matched node, principal = the requester
    cross_hit  rid, node_id = last matched node, num_tokens = matched tokens in nodes owned by a principal
               other than the requester (nodes with no owner do not count), principal = the requester
    promote    node_id, num_tokens, principal = the node's owner, aux = distinct creators in the window
    demote     node_id = subtree root, num_tokens = tokens in the subtree, principal = the principals
               involved joined by "," (cut to 64 chars), aux = how many
    insert     num_tokens = new tokens placed in a new node, node_id = that node, aux = its parent,
               principal = the new node's owner (None: no owner)
    split      node_id = the new upper node, aux = the node that was split (the upper node keeps its owner)
    lock/unlock node_id = the node the lock starts at, num_tokens = tokens whose state moved,
               aux = SWA tokens whose state moved (swa-radix); a copy lock (hiradix: held by a
               write or load in flight, not by a request): rid None, reason = the CopyKind,
               aux = the op id
    evict      node_id, num_tokens, slots freed, reason (capacity, finish, abort, tombstone; hiradix:
               to-host = the node keeps its host copy, drop = write_back deleted a leaf the host
               could not take, with its host-only subtree; an attached engine: reset = its cache was
               cleared)
    tombstone  node_id, num_tokens = SWA tokens freed, slots = the SWA-freed full slots
    revive     node_id: a tombstone got live SWA KV again (SWA radix insert); recorded twice: pool full
               with the node's full slots, then pool swa with the SWA slots now paired with them
    inject     rid, reason = the FaultKind, slots / node_id = what the fault touched
    violation  rid, reason = the FaultKind caught, slots read, aux = the position read
    alloc/free pool, rid, num_tokens, slots
hiradix, the host tier (pool = the tier whose slots the event names: host or full = device):
    write      pool host, node_id, num_tokens, slots = the host slots now holding the node's copy,
               aux = the op id (a device -> host copy in flight until its ack)
    load       pool full, node_id = the deepest node loaded (locked until the ack), num_tokens,
               slots = the new device slots (each node's share follows as a revive), aux = the op id
    ack        the controller acknowledged op `aux`: reason = the CopyKind, pool host (a write) or
               full (a load), node_id = the op's node, num_tokens = the tokens it copied
    host_evict pool host, node_id, num_tokens, slots = the host copy leaving the tree (the host
               allocator's free follows), reason capacity (evict_host) or drop (under a dropped leaf)
Producers guard every call with `if recorder.enabled:` so a disabled recorder costs one
flag check. Slots are passed as they are (tensor or array) and a recorder may keep a
reference until it flushes: a producer must never write into a recorded slot array
afterwards. kvscope's pools and caches only ever create new arrays (slicing, cat, copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, NamedTuple


class EventKind(StrEnum):
    REQUEST_ARRIVE = "arrive"
    REQUEST_ADMIT = "admit"
    REQUEST_FINISH = "finish"
    REQUEST_RETRACT = "retract"
    REQUEST_ABORT = "abort"
    MATCH = "match"
    ALLOC = "alloc"
    FREE = "free"
    INSERT = "insert"
    SPLIT = "split"
    LOCK = "lock"
    UNLOCK = "unlock"
    EVICT = "evict"
    TOMBSTONE = "tombstone"
    REVIVE = "revive"
    LEAK_CHECK = "leak_check"
    INJECT = "inject"  # a fault injected on purpose (ground truth for the debugger's tests)
    VIOLATION = "violation"  # a misuse caught while running (e.g. a read of a freed slot)
    PROMOTE = "promote"  # scoped radix: a private node became public
    DEMOTE = "demote"  # scoped radix: a public subtree became private again
    CROSS_HIT = "cross_hit"  # a match reused tokens in nodes another principal owns
    WRITE = "write"  # hiradix: a node's KV is being copied device -> host
    LOAD = "load"  # hiradix: host-only nodes are being copied host -> device
    ACK = "ack"  # hiradix: the controller acknowledged a write or a load
    HOST_EVICT = "host_evict"  # hiradix: a host copy left the tree
    NO_ROOM = "no_room"  # vLLM probe: allocate_slots found no room (num_tokens = tokens asked, aux = free blocks)


class EvictReason(StrEnum):
    CAPACITY = "capacity"
    FINISH = "finish"
    ABORT = "abort"
    TOMBSTONE = "tombstone"
    TO_HOST = "to-host"  # hiradix: a backed-up device leaf became host-only
    DROP = "drop"  # hiradix write_back: deleted, the host could not take it
    RESET = "reset"  # an attached engine's cache was cleared (its AllBlocksCleared; schema version 5)


class LookupStop(StrEnum):
    """Why a prefix lookup stopped where it did: a match event's reason (the vLLM probe; docs/probe.md)."""

    SHORT = "short"  # no full block before the prompt's last token: nothing to look up
    MISS = "miss"  # the first block's hash is not cached
    DIVERGED = "diverged"  # a later block's hash is not cached (chained hashes: nothing after it can hit)
    PARTIAL = "partial"  # every full block hit; the rest is a partial block, which is never cached
    CAPPED = "capped"  # every full block hit but the last, which the last-token rule leaves to recompute
    OTHER = "other"  # a layout the probe does not model (several groups, sliding window, EAGLE, sub-block hashes)


class CopyKind(StrEnum):
    """A host-tier copy (hiradix): the reason of its ack event and of the lock it holds."""

    WRITE = "write"  # device -> host
    LOAD = "load"  # host -> device


class Visibility(StrEnum):
    """Who may see a tree node (the scoped radix cache; every other tree is public): an insert
    event's reason, and the tree snapshots' visibility column."""

    PRIVATE = "private"
    PUBLIC = "public"
    PINNED = "pinned"


class FaultKind(StrEnum):
    LEAK_TAIL = "leak-tail"
    LOCK_LEAK = "lock-leak"
    DOUBLE_FREE = "double-free"
    USE_AFTER_FREE = "use-after-free"
    SWA_WINDOW_LEAK = "swa-window-leak"
    HOST_LEAK = "host-leak"


class PoolName(StrEnum):
    FULL = "full"
    SWA = "swa"
    REQ = "req"
    HOST = "host"


class Event(NamedTuple):
    kind: EventKind
    pool: PoolName | None
    rid: str | None
    node_id: int | None
    num_tokens: int
    slots: Any
    reason: StrEnum | None
    aux: int
    principal: str | None = None


class Recorder:
    """Base recorder: records nothing.

    `enabled` (level full) turns on memory events; `summary_enabled` (level summary and up)
    turns on the per-step records: usage samples, leak checks, requests, tree snapshots.
    """

    enabled: bool = False
    summary_enabled: bool = False
    step: int = 0

    def usage(self, sample: Any) -> None:
        """A UsageSample for the current step."""

    def leak_check(self, check: Any) -> None:
        """A LeakCheck (one pool's invariant terms)."""

    def census_blocks(self, blocks: list[Any]) -> None:
        """CensusBlocks: every block a census names (its leak checks' messages name a few)."""

    def request(self, rec: Any) -> None:
        """A RequestRecord, once, when the request ends (or the run closes)."""

    def tree_snapshot(self, step: int, rows: list[Any]) -> None:
        """The cache's flat node table at `step` (NodeRow tuples)."""

    def idle(self) -> None:
        """The producer has nothing in flight: what is buffered should reach the capture now,
        not when the next step begins (which may be a long wait)."""

    def close(self, status: str = "finished", error: str | None = None) -> None:
        """Flush and mark the run ended."""

    def record(
        self,
        kind: EventKind,
        *,
        pool: PoolName | None = None,
        rid: str | None = None,
        node_id: int | None = None,
        num_tokens: int = 0,
        slots: Any = None,
        reason: StrEnum | None = None,
        aux: int = 0,
        principal: str | None = None,
    ) -> None:
        """Append one event. Called only when `enabled`; must not raise on the hot path.
        `reason` is an EvictReason, or a FaultKind for inject / violation events; `principal`
        is the owner of the node an insert event creates, or the requester of a match (see above)."""

    def record_batch(
        self,
        kind: EventKind,
        *,
        pool: PoolName | None,
        rids: Sequence[str | None],
        num_tokens: Sequence[int],
        slots: Any,
    ) -> None:
        """One event per request of a batch, in order: request i gets the next num_tokens[i] of
        `slots` (which holds sum(num_tokens) slots). The same events as that many record()
        calls; a recorder may keep the batch as one item until it writes."""
        start = 0
        for rid, count in zip(rids, num_tokens, strict=True):
            self.record(kind, pool=pool, rid=rid, num_tokens=count, slots=slots[start : start + count])
            start += count


class NullRecorder(Recorder):
    enabled = False


NULL_RECORDER = NullRecorder()


class ListRecorder(Recorder):
    """Keeps everything in lists: for tests and small in-process inspection."""

    enabled = True
    summary_enabled = True

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.samples: list[Any] = []
        self.checks: list[Any] = []
        self.blocks: list[Any] = []
        self.requests: list[Any] = []
        self.snapshots: dict[int, list[Any]] = {}

    def usage(self, sample: Any) -> None:
        self.samples.append(sample)

    def leak_check(self, check: Any) -> None:
        self.checks.append(check)

    def census_blocks(self, blocks: list[Any]) -> None:
        self.blocks.extend(blocks)

    def request(self, rec: Any) -> None:
        self.requests.append(rec)

    def tree_snapshot(self, step: int, rows: list[Any]) -> None:
        self.snapshots[step] = list(rows)

    def record(
        self,
        kind: EventKind,
        *,
        pool: PoolName | None = None,
        rid: str | None = None,
        node_id: int | None = None,
        num_tokens: int = 0,
        slots: Any = None,
        reason: StrEnum | None = None,
        aux: int = 0,
        principal: str | None = None,
    ) -> None:
        kept = None if slots is None else [int(s) for s in slots]
        self.events.append(Event(kind, pool, rid, node_id, num_tokens, kept, reason, aux, principal))

    def of_kind(self, kind: EventKind) -> list[Event]:
        return [e for e in self.events if e.kind is kind]
