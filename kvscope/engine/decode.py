"""The decode half of the scheduler (semantics note §9.3): memory check, retraction, window
freeing, one slot per request, forward, sampling, finish.

NOTE: retraction order: requests sorted by (len(output), -len(prompt)) descending; victims
are popped from the end (fewest outputs first; among ties the longest prompt), always
keeping one. new_token_ratio decays by `decay` per successful check, and after a retraction
becomes min(1, (decoded + retract_decode_steps * n) / (Σ max_new + 1)) over those kept.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from kvscope.engine import fault_hooks
from kvscope.engine.config import SchedulerConfig
from kvscope.engine.faults import FaultInjector
from kvscope.engine.memory import MemorySystem
from kvscope.engine.model import ForwardBatch, TinyTransformer
from kvscope.engine.request import Req
from kvscope.engine.stats import EngineStats
from kvscope.telemetry import Recorder


def held_rows(batch: list[Req]) -> list[int]:
    """The req_to_token rows of a batch whose requests all hold one."""
    rows = [r.req_pool_idx for r in batch]
    if None in rows:
        raise RuntimeError("a request in a forward batch holds no req_to_token row (this is a kvscope bug)")
    return [r for r in rows if r is not None]



class DecodeMixin:
    """Mixed into Scheduler; uses its queues, memory, model, stats and hooks."""

    sched: SchedulerConfig
    memory: MemorySystem
    model: TinyTransformer
    recorder: Recorder
    stats: EngineStats
    faults: FaultInjector | None
    on_logits: Any
    running: list[Req]
    waiting: deque[Req]
    new_token_ratio: float

    # provided by Scheduler (annotations only, so they shadow nothing in the MRO)
    _check_reads: Callable[[list[Req], list[int]], None]
    _free_window: Callable[[Req, int], None]
    _finish: Callable[[Req], None]
    _retract: Callable[[Req], None]
    _abort: Callable[[Req, str], None]

    # -- decode ------------------------------------------------------------------------------

    def _run_decode(self) -> None:
        self._ensure_decode_memory()
        batch = self.running
        if not batch:
            return
        memory = self.memory
        if memory.is_swa:
            self._free_windows_for_decode(batch)
        if self.faults is not None:
            for req in batch:
                fault_hooks.maybe_use_after_free(self.faults, memory, req)
        row_ids = held_rows(batch)
        positions = [r.kv_committed_len for r in batch]
        slots = self._alloc_decode(batch, row_ids, positions)
        rows = memory.req_to_token_pool
        rows.write_tokens(row_ids, positions, slots)
        input_ids = torch.tensor([r.output_ids[-1] for r in batch], dtype=torch.int64)
        forward = ForwardBatch.build("decode", input_ids, held_rows(batch), [r.kv_committed_len for r in batch], slots)
        self._check_reads(batch, positions)
        logits = self.model.forward(forward, rows, memory.kv_pool)
        memory.allocator.free_group_begin()
        still_running = []
        sampled = logits.argmax(-1).tolist()  # NOTE: one device sync per step, not one per request
        for req, row, token in zip(batch, logits, sampled, strict=True):
            req.kv_committed_len += 1
            req.decode_steps += 1
            if self.on_logits is not None:
                self.on_logits(req, req.kv_committed_len - 1, row)
            req.append_output(req.next_token(token))
            if req.is_done():
                self._finish(req)
            else:
                still_running.append(req)
        memory.allocator.free_group_end()
        self.running = still_running

    def _alloc_decode(self, batch: list[Req], row_ids: list[int], positions: list[int]) -> torch.Tensor:
        allocator = self.memory.allocator
        allocator.active_batch = [(r.rid, 1) for r in batch]
        if self.memory.page_size == 1:
            slots = allocator.alloc(len(batch))
        else:
            last = self.memory.req_to_token_pool.read_tokens(row_ids, [p - 1 for p in positions])
            slots = allocator.alloc_decode([p + 1 for p in positions], last)
        allocator.active_batch = None
        if slots is None:
            raise RuntimeError("Decode out of memory after the memory check (this is a kvscope bug)")
        return slots

    def _decode_need(self, reqs: list[Req]) -> int:
        ps = self.memory.page_size
        return ps * sum(1 for r in reqs if r.kv_committed_len % ps == 0)

    def _decode_fits(self, reqs: list[Req]) -> bool:
        memory = self.memory
        need = self._decode_need(reqs)
        self.stats.evicted(memory.evict(need - memory.full_available(), need - memory.swa_available()))
        return memory.full_available() >= need and (not memory.is_swa or memory.swa_available() >= need)

    def _ensure_decode_memory(self) -> None:
        if self._decode_fits(self.running):
            self.new_token_ratio = max(self.new_token_ratio - self.sched.new_token_ratio_decay,
                                       self.sched.min_new_token_ratio)
            return
        keep = sorted(self.running, key=lambda r: (len(r.output_ids), -r.prompt_len), reverse=True)
        retracted: list[Req] = []
        while keep and not self._decode_fits(keep):
            victim = keep.pop()
            if not keep:
                self._abort(victim, "out of memory even after retracting all other requests in the decode batch")
                break
            self._retract(victim)
            retracted.append(victim)
        self.running = [r for r in self.running if r in keep]
        if keep:
            future = len(keep) * self.sched.retract_decode_steps
            self.stats.evicted(self.memory.evict(future - self.memory.full_available(),
                                                 future - self.memory.swa_available()))
            decoded = sum(len(r.output_ids) for r in keep)
            budget = sum(r.max_new_tokens for r in keep)
            self.new_token_ratio = min(1.0, (decoded + self.sched.retract_decode_steps * len(keep)) / (budget + 1))
        for req in reversed(retracted):
            self.waiting.appendleft(req)

    def _free_windows_for_decode(self, batch: list[Req]) -> None:
        window, interval = self.memory.window_len, self.sched.swa_eviction_interval
        assert window is not None
        for req in batch:
            pre_len = req.kv_committed_len
            if req.decode_steps >= 1 and pre_len - window >= req.swa_evicted_len + interval:
                self._free_window(req, pre_len)

