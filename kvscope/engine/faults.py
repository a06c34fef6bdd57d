"""Fault injection for demos and tests: seeded, deterministic, each injection logged in the
capture as an `inject` event (the ground truth the debugger's report is checked against).

NOTE: what each fault does, and where
    leak-tail         at finish: the request's last own page (slot, at page size 1: two) is
                      never freed: the cache is told the KV ends before it
    lock-leak         at finish: the request's lock on its last tree node is never released
    double-free       at finish: slots the release just freed are freed once more
    use-after-free    at decode: one page the request still reads is freed under it
    swa-window-leak   when the window moves: the SWA slots that left it are dropped from the
                      mapping and never freed
    host-leak         hiradix, when a host copy leaves the tree (host eviction, or under a
                      dropped leaf): its host slots are never freed
Each request gets at most one fault of each kind, with probability `rate`; host-leak decides
once per node instead (its inject event has rid None and names the node).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvscope.engine.cache_kinds import either, kinds_with
from kvscope.mem import TokenAllocator
from kvscope.telemetry import EventKind, FaultKind, Recorder

TREE_ONLY = {FaultKind.LOCK_LEAK}
SWA_ONLY = {FaultKind.SWA_WINDOW_LEAK}
HOST_ONLY = {FaultKind.HOST_LEAK}


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    rate: float = 1.0

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """'KIND' or 'KIND:RATE', e.g. 'leak-tail:0.25'."""
        name, _, rate = text.partition(":")
        if name not in FaultKind._value2member_map_:
            raise ValueError(f"unknown fault {name!r}; choose one of {', '.join(k.value for k in FaultKind)}")
        try:
            value = float(rate) if rate else 1.0
        except ValueError:
            raise ValueError(f"fault rate {rate!r} is not a number") from None
        if not 0 < value <= 1:
            raise ValueError(f"fault rate must be in (0, 1], got {value}")
        return cls(FaultKind(name), value)


class FaultInjector:
    def __init__(self, specs: list[FaultSpec], seed: int, recorder: Recorder) -> None:
        self.rates = {s.kind: s.rate for s in specs}
        self.rng = np.random.default_rng(seed)
        self.recorder = recorder
        self.done: set[tuple[FaultKind, str]] = set()
        self.log: list[tuple[FaultKind, str | None, list[int], int | None]] = []  # kind, rid, slots, node

    def wants(self, kind: FaultKind, target: str) -> bool:
        """Decide once per (kind, target), deterministically for the seed; the target is a
        request id (host-leak: `node_target(node_id)`)."""
        if kind not in self.rates or (kind, target) in self.done:
            return False
        self.done.add((kind, target))
        return bool(self.rng.random() < self.rates[kind])

    def injected(self, kind: FaultKind, rid: str | None, slots: Any = None, node_id: int | None = None) -> None:
        kept = [] if slots is None else [int(s) for s in slots]
        self.log.append((kind, rid, kept, node_id))
        if self.recorder.enabled:
            self.recorder.record(
                EventKind.INJECT,
                rid=rid,
                node_id=node_id,
                num_tokens=len(kept),
                slots=None if slots is None else np.asarray(kept, dtype=np.int64),
                reason=kind,
            )


def node_target(node_id: int) -> str:
    """The target a per-node fault (host-leak) is decided for, apart from any request id."""
    return f"node:{node_id}"


def check_applicable(specs: list[FaultSpec], has_tree: bool, is_swa: bool, has_host: bool = False) -> None:
    for spec in specs:
        if spec.kind in TREE_ONLY and not has_tree:
            raise ValueError(
                f"fault {spec.kind} needs a cache with a tree ({either(kinds_with(lambda kind: kind.has_tree))})"
            )
        if spec.kind in HOST_ONLY and not has_host:
            raise ValueError(
                f"fault {spec.kind} needs a host tier (--cache {either(kinds_with(lambda kind: kind.has_host))})"
            )
        if spec.kind in SWA_ONLY and not is_swa:
            raise ValueError(f"fault {spec.kind} needs a sliding-window model (e.g. --model tiny-swa)")


@contextmanager
def observe_frees(allocator: TokenAllocator) -> Iterator[list[torch.Tensor]]:
    """Collect the full-pool slots freed inside the block (for double-free); may repeat slots.

    NOTE: spies on the full-attention pool's own free and free_segments (an SWA allocator
    frees both halves through its full pool's free)."""
    seen: list[torch.Tensor] = []
    target = allocator.full_attn_allocator
    methods = ["free", "free_segments"]

    def spy(name: str, original: Any) -> Any:
        def call(arg: Any, *rest: Any) -> None:
            pieces = [s for s, _ in arg] if name == "free_segments" else [arg]
            seen.extend(p.clone() for p in pieces if p.numel())
            original(arg, *rest)

        return call

    for name in methods:
        setattr(target, name, spy(name, getattr(target, name)))
    try:
        yield seen
    finally:
        for name in methods:
            delattr(target, name)
