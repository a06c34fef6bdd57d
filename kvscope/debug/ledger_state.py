"""A ledger's whole state as bytes and back: what a ledger checkpoint stores (schema
ledger_checkpoints), so a replay of a run whose oldest events were dropped by retention resumes
where the checkpoint stops and reaches the same state as a replay from the run's first event.

NOTE: the format (FORMAT names it; a checkpoint of another format is not read)
    A compressed .npz archive (numpy, never pickle: a capture may come from anyone): the pools' per-slot
    arrays as `<pool>.<field>`, the nodes' device slots and host copies as keys, lengths and the
    slots laid end to end, and `meta`, the UTF-8 JSON of everything else (owners' counts, requests,
    ended requests, nodes that left, copy ops, SWA pairs, locks, defects found so far) with the
    replay's own `extra` (its current step, the onset so far).
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from typing import Any

import numpy as np

from kvscope.debug.ledger import BadRead, CopyOp, DoubleFree, HeldLock, Ledger, StuckOp
from kvscope.debug.slot_table import PoolLedger

FORMAT = "kvscope ledger state 1"


def encode(ledger: Ledger, extra: dict[str, Any]) -> bytes:
    arrays: dict[str, np.ndarray] = {}
    for pool, table in ledger.pools.items():
        for name, _fill in PoolLedger.FIELDS:
            arrays[f"{pool}.{name}"] = getattr(table, name)
    for name, slots_of in (("node_slots", ledger.node_slots), ("host_copies", ledger.host_copies)):
        keys = sorted(slots_of)
        arrays[f"{name}.keys"] = np.asarray(keys, np.int64)
        arrays[f"{name}.lengths"] = np.asarray([len(slots_of[k]) for k in keys], np.int64)
        arrays[f"{name}.slots"] = np.concatenate(
            [np.asarray(slots_of[k], np.int64) for k in keys] or [np.empty(0, np.int64)]
        )
    owners = ledger.owners
    meta = {
        "held": {str(kind): [[r, n] for r, n in table.items() if n] for kind, table in owners.held.items()},
        "touched": sorted(owners.touched),
        "orphaned": sorted(owners.orphaned),
        "rids": ledger.rids,
        "live": sorted(ledger.live),
        "ended": [[i, how, step] for i, (how, step) in ledger.ended.items()],
        "gone": [[kind, node, step] for (kind, node), step in ledger.gone.items()],
        "in_flight": [[op, *copy] for op, copy in ledger.in_flight.items()],
        "stuck_ops": [[s.op, list(s.copy), s.idle_step, s.idle_seq] for s in ledger.stuck_ops],
        "full_to_swa": list(ledger.full_to_swa.items()),
        "swa_to_full": list(ledger.swa_to_full.items()),
        "locks": [list(lock) for lock in ledger.locks],
        "double_frees": [list(d) for d in ledger.double_frees],
        "bad_reads": [list(b) for b in ledger.bad_reads],
        "last_seq": ledger.last_seq,
        "pending_full": [[rid, slots.tolist()] for rid, slots in ledger.pending()],
        "extra": extra,
    }
    arrays["meta"] = np.frombuffer(json.dumps(meta, default=int).encode(), np.uint8)
    out = io.BytesIO()
    np.savez_compressed(out, allow_pickle=False, **arrays)  # NOTE: the per-slot arrays are mostly their fill values
    return out.getvalue()


def decode(body: bytes) -> tuple[Ledger, dict[str, Any]]:
    """The ledger and the replay's `extra`; ValueError for a body that is not such a state."""
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        meta = json.loads(arrays["meta"].tobytes().decode())
        return _ledger(arrays, meta), dict(meta["extra"])
    except (OSError, KeyError, TypeError, ValueError, EOFError) as err:
        raise ValueError(f"not a ledger state ({type(err).__name__}: {err})") from err


def _ledger(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Ledger:
    ledger = Ledger()
    for pool, table in ledger.pools.items():
        for name, _fill in PoolLedger.FIELDS:
            setattr(table, name, arrays[f"{pool}.{name}"].copy())
    for name in ("node_slots", "host_copies"):
        ends = np.cumsum(arrays[f"{name}.lengths"])
        parts = np.split(arrays[f"{name}.slots"].astype(np.int64), ends[:-1]) if len(ends) else []
        setattr(ledger, name, dict(zip(arrays[f"{name}.keys"].tolist(), parts, strict=True)))
    owners = ledger.owners
    for kind, pairs in meta["held"].items():
        owners.held[int(kind)] = defaultdict(int, {int(r): int(n) for r, n in pairs})
    owners.touched = {(int(k), int(r)) for k, r in meta["touched"]}
    owners.orphaned = {(int(k), int(r)) for k, r in meta["orphaned"]}
    ledger.rids = list(meta["rids"])
    ledger.rid_index = {rid: i for i, rid in enumerate(ledger.rids)}
    ledger.live = set(meta["live"])
    ledger.ended = {int(i): (str(how), int(step)) for i, how, step in meta["ended"]}
    ledger.gone = {(int(kind), int(node)): int(step) for kind, node, step in meta["gone"]}
    ledger.in_flight = {int(op): CopyOp(*copy) for op, *copy in meta["in_flight"]}
    ledger.stuck_ops = [StuckOp(op, CopyOp(*copy), idle, seq) for op, copy, idle, seq in meta["stuck_ops"]]
    ledger.full_to_swa = {int(a): int(b) for a, b in meta["full_to_swa"]}
    ledger.swa_to_full = {int(a): int(b) for a, b in meta["swa_to_full"]}
    ledger.locks = [HeldLock(*lock) for lock in meta["locks"]]
    ledger.double_frees = [DoubleFree(*d) for d in meta["double_frees"]]
    ledger.bad_reads = [BadRead(*b) for b in meta["bad_reads"]]
    ledger.last_seq = int(meta["last_seq"])
    ledger._pending_full = [(rid, np.asarray(slots, np.int64)) for rid, slots in meta["pending_full"]]
    return ledger
