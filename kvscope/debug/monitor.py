"""Debug mode: a recorder wrapper that keeps the ledger live, poisons freed K/V with NaN,
and checks every slot a request is about to read, so a use-after-free is caught at the read.

It passes every event on to the run's own recorder (when that one wants events), so a
capture at any level is written as without debugging. The engine takes it twice, by
interface: as its recorder and as its read checker (kvscope.engine.ReadChecker).

NOTE: it imports kvscope.mem only for the two KV pool types whose freed rows it poisons.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import numpy as np
import torch

from kvscope.debug.ledger import Ledger
from kvscope.mem import KVPool
from kvscope.telemetry import EventKind, FaultKind, PoolName, Recorder


def _as_slots(slots: Any) -> np.ndarray | None:
    if slots is None:
        return None
    if isinstance(slots, torch.Tensor):
        return slots.detach().cpu().numpy().astype(np.int64)
    return np.asarray(slots, dtype=np.int64)


class DebugMonitor(Recorder):
    enabled = True

    def __init__(self, inner: Recorder) -> None:
        self.inner = inner
        self.summary_enabled = inner.summary_enabled
        self.ledger = Ledger()
        self.kv_pool: KVPool | None = None
        self.violations: list[tuple[str, list[int], int]] = []  # (rid, slots, step)
        self._seq = 0
        self._step = 0

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        self.inner.step = value

    def idle(self) -> None:
        self.inner.idle()

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
        host = _as_slots(slots)
        self.ledger.apply(kind, self._step, self._seq, pool and pool.value, rid, node_id, num_tokens, aux, host, reason)
        self._seq += 1
        if kind is EventKind.FREE and host is not None and len(host):
            self._poison(pool, host)
        if self.inner.enabled:
            self.inner.record(
                kind,
                pool=pool,
                rid=rid,
                node_id=node_id,
                num_tokens=num_tokens,
                slots=slots,
                reason=reason,
                aux=aux,
                principal=principal,
            )

    def _poison(self, pool: PoolName | None, slots: np.ndarray) -> None:
        kv = self.kv_pool
        if kv is None or pool is PoolName.HOST:  # NOTE: host slots index the host pool, which no forward reads
            return
        target = kv.buffers_of(pool.value if pool is not None else PoolName.FULL.value)
        if not target.dtype.is_floating_point or target.store_dtype != target.dtype:
            return
        index = torch.from_numpy(slots).to(target.device)
        for layer in range(target.num_layers):
            target.k_buffer[layer][index] = float("nan")
            target.v_buffer[layer][index] = float("nan")

    def attach_kv_pool(self, kv_pool: KVPool) -> None:
        """The engine's KV buffers, whose freed rows are poisoned from now on."""
        self.kv_pool = kv_pool

    def check_reads(self, rid: str, slots: torch.Tensor) -> None:
        """Before a forward: may `rid` read these slots (its positions [0, len(slots)))? Records
        a violation naming the request, the slots and the first bad position."""
        host = _as_slots(slots)
        assert host is not None
        bad = self.ledger.read_violations(rid, host)
        if not len(bad):
            return
        position = int(np.flatnonzero(np.isin(host, bad))[0])
        self.violations.append((rid, bad.tolist(), self._step))
        self.record(
            EventKind.VIOLATION, rid=rid, slots=bad, reason=FaultKind.USE_AFTER_FREE, aux=position, num_tokens=len(bad)
        )

    # -- the rest goes to the run's recorder -------------------------------------------------

    def usage(self, sample: Any) -> None:
        self.inner.usage(sample)

    def leak_check(self, check: Any) -> None:
        self.inner.leak_check(check)

    def request(self, rec: Any) -> None:
        self.inner.request(rec)

    def tree_snapshot(self, step: int, rows: list[Any]) -> None:
        self.inner.tree_snapshot(step, rows)

    def close(self, status: str = "finished", error: str | None = None) -> None:
        self.inner.close(status, error)
