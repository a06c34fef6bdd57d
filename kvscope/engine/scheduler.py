"""The scheduler loop, SGLang's way (docs/memory-semantics.md §3, §9): prefill when something can be
admitted, else decode the running batch, else run the idle leak check.

NOTE: one step
    prefill  (lpm: sort the queue by visible match) admit (match, lock, budget), rows,
             evict the shortfall, allocate, forward,
             then per request: chunk -> cache_unfinished_req(chunked); prompt done ->
             first output token, cache_unfinished_req (or finish)
    decode   check memory (evict, else retract the requests with the fewest outputs),
             free out-of-window SWA, allocate one slot each, forward, sample, finish
    idle     the 5-term leak check per pool; reset new_token_ratio
hiradix (docs/memory-semantics.md §7): every step first turns the controller's acknowledgements
into lock releases (writing_check, loading_check: SGLang's check_hicache_events); admission
loads a host hit back (init_load_back, under the request's temporary lock, within the budget)
and the prefill forward waits for those loads; an idle point drains every copy first.
Frees of one step's results happen inside one free group.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import torch

from kvscope.cache.base import MatchResult
from kvscope.cache.hiradix import HiMatchResult, HiRadixCache
from kvscope.engine import fault_hooks
from kvscope.engine.admission import PrefillAdder
from kvscope.engine.config import EngineConfig
from kvscope.engine.faults import FaultInjector
from kvscope.engine.memory import MemorySystem, WindowHook
from kvscope.engine.model import ForwardBatch, TinyTransformer
from kvscope.engine.read_check import ReadChecker
from kvscope.engine.request import Req, ReqState
from kvscope.engine.sampling import choose_tokens
from kvscope.engine.stats import EngineStats, LeakDetected
from kvscope.mem import charged_to, charged_to_batch
from kvscope.telemetry import Recorder

LogitsHook = Callable[[Req, int, torch.Tensor], None]  # (request, position, logits row)
LPM_MAX_WAITING = 128  # SGLang's lpm keeps arrival order when more requests than this wait


def held_rows(batch: list[Req]) -> list[int]:
    """The req_to_token rows of a batch whose requests all hold one."""
    rows = [r.req_pool_idx for r in batch]
    if None in rows:
        raise RuntimeError("a request in a forward batch holds no req_to_token row (this is a kvscope bug)")
    return [r for r in rows if r is not None]


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        model: TinyTransformer,
        memory: MemorySystem,
        recorder: Recorder,
        on_logits: LogitsHook | None = None,
        read_checker: ReadChecker | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        self.config = config
        self.sched = config.scheduler
        self.model = model
        self.memory = memory
        self.recorder = recorder
        self.on_logits = on_logits
        self.read_checker = read_checker
        self.faults = faults
        self.window_hook: WindowHook | None = (
            None if faults is None else partial(fault_hooks.maybe_swa_window_leak, faults)
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.step = 0
        self.stalled_steps = 0  # steps in a row that admitted and ran nothing while requests waited
        self.last_snapshot_step = -1
        self.new_token_ratio = self.sched.init_new_token_ratio
        self.stats = EngineStats(recorder)
        # NOTE: lpm needs a tree to match against; a chunk cache (none) keeps arrival order
        self.sorts_by_prefix = self.sched.schedule_policy == "lpm" and not memory.cache.disabled
        # NOTE: the two-tier cache's extra work, decided once: other caches' steps never pay for it
        self.hicache: HiRadixCache | None = memory.cache if isinstance(memory.cache, HiRadixCache) else None

    # -- the loop ----------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        req.arrival_step = self.step
        req.last_node = self.memory.cache.root
        self.waiting.append(req)
        self.stats.arrived(req, self.step)

    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked_req is None

    def run_step(self) -> None:
        self.step += 1
        self.recorder.step = self.step
        if self.hicache is not None:
            self._check_hicache_events(self.hicache)
        admitted = self._prefill_batch()
        if admitted:
            self._run_prefill(admitted)
        elif self.running:
            self._run_decode()
        # NOTE: nothing admitted and nothing running while requests wait: memory frees only when a
        # request ends or a copy is acknowledged, so a few such steps in a row mean none ever will
        self.stalled_steps = 0 if admitted or self.running else self.stalled_steps + 1
        self.stats.sample(self.step, self.memory, len(self.running), len(self.waiting))
        if self.recorder.summary_enabled and self.step % self.sched.snapshot_interval_steps == 0:
            self.snapshot()

    def on_idle(self) -> bool:
        """The idle leak check; returns whether every pool balanced. hiradix: every copy is
        drained and acknowledged first (an unacknowledged write still locks its node)."""
        if self.hicache is not None:
            self.hicache.controller.wait_all()
            self._check_hicache_events(self.hicache)
        checks = self.memory.leak_checks(self.step, [])
        self.new_token_ratio = self.sched.init_new_token_ratio
        ok = self.stats.leak_checked(checks)
        if not ok and self.sched.leak_check_raise:
            raise LeakDetected("pool memory leak detected! " + "\n".join(c.message() for c in checks if not c.ok))
        return ok

    @staticmethod
    def _check_hicache_events(cache: HiRadixCache) -> None:
        """Acknowledged writes and loads release their locks (and loads their host pins)."""
        cache.writing_check()
        cache.loading_check()

    def snapshot(self) -> None:
        """The tree at this step, once per step (the end of a run may fall on a periodic one)."""
        if self.step == self.last_snapshot_step:
            return
        self.last_snapshot_step = self.step
        self.recorder.tree_snapshot(self.step, self.memory.cache.export_nodes())

    # -- prefill -----------------------------------------------------------------------------

    def _prefill_batch(self) -> list[Req]:
        if not self.waiting and self.chunked_req is None:
            return []
        pool = self.config.pool
        adder = PrefillAdder(
            self.memory,
            self.running,
            self.new_token_ratio,
            self.sched.clip_max_new_tokens,
            self.sched.max_prefill_tokens,
            self.sched.chunked_prefill_size,
        )
        if self.chunked_req is not None:
            adder.add_chunked(self.chunked_req)
        if (
            self.sorts_by_prefix
            and len(self.waiting) <= LPM_MAX_WAITING
            and len(self.running) + len(adder.admitted) < pool.max_running_requests
        ):
            self._sort_by_prefix()
        while self.waiting:
            if adder.admitted and adder.admitted[-1].req.is_chunked:
                break  # a chunked request ends the batch
            if len(self.running) + len(adder.admitted) >= pool.max_running_requests:
                break
            if not self._try_admit(self.waiting[0], adder):
                break
            self.waiting.popleft()
        return [a.req for a in adder.admitted]

    def _sort_by_prefix(self) -> None:
        """SGLang's lpm: the longest cached prefix first, ties in arrival order. The match is the
        one admission makes (§3.1): the prefix the request's own principal can see, nothing else.

        NOTE: a read for ordering only. Nothing is locked (admission matches again), and the
        match carries no rid: a MATCH event with a rid marks its request as running in the
        telemetry (derived.running_lengths), which a waiting request is not."""
        cache = self.memory.cache

        def longest_first(req: Req) -> int:
            return -cache.match_prefix(req.all_ids()[: req.all_len - 1], user=req.user).prefix_len

        self.waiting = deque(sorted(self.waiting, key=longest_first))  # NOTE: stable: ties keep arrival order

    def prefill_candidates(self) -> Iterator[Req]:
        """The waiting requests the next prefill pass may admit: the queue's head, or under lpm the
        whole queue (the pass sorts it first)."""
        if self.sorts_by_prefix and len(self.waiting) <= LPM_MAX_WAITING:
            return iter(self.waiting)
        return itertools.islice(self.waiting, self.config.pool.max_running_requests)

    def _try_admit(self, req: Req, adder: PrefillAdder) -> bool:
        """Match, lock, budget; on success the request's prefix state is set from the match."""
        cache = self.memory.cache
        all_ids = req.all_ids()
        match = cache.match_prefix(all_ids[: req.all_len - 1], user=req.user, rid=req.rid)
        lock_id = cache.inc_lock_ref(match.last_node, rid=req.rid)
        device_len = match.prefix_len
        if self.hicache is not None:
            match, lock_id = self._load_back(self.hicache, req, match, lock_id, adder)
        prefix_len = match.prefix_len
        fits = adder.try_add(req, prefix_len)
        if not fits and (not adder.admitted or adder.admitted[-1].req is not req):
            cache.dec_lock_ref(match.last_node, lock_id, rid=req.rid)
            return False
        req.prefix_indices, req.last_node, req.swa_lock_id = match.device_indices, match.last_node, lock_id
        req.cache_protected_len = req.kv_committed_len = req.swa_evicted_len = prefix_len
        if not req.admitted:
            req.admitted = True
            req.cached_tokens = prefix_len
        self.stats.admitted(req, self.step, prefix_len, host_hit_tokens=prefix_len - device_len)
        return True

    def _load_back(
        self, cache: HiRadixCache, req: Req, match: MatchResult, lock_id: int | None, adder: PrefillAdder
    ) -> tuple[MatchResult, int | None]:
        """init_load_back as SGLang's PrefillAdder runs it (§9.2 step 5): with the matched device
        prefix locked, load the host hit behind it within what the budget leaves; on success the
        request's lock moves down to the loaded node and its prefix grows by the loaded slots.
        Returns the (possibly extended) match and the request's lock id."""
        if not isinstance(match, HiMatchResult) or match.host_hit_length <= 0:
            return match, lock_id
        quota = adder.load_quota(req, match.prefix_len + match.host_hit_length)
        evicted_before = cache.num_load_evicted_tokens
        loaded, node = cache.init_load_back(match.last_host_node, match.host_hit_length, quota)
        self.stats.evicted(cache.num_load_evicted_tokens - evicted_before)  # NOTE: a load makes its own room
        if not len(loaded):
            return match, lock_id
        new_lock = cache.inc_lock_ref(node, rid=req.rid)
        cache.dec_lock_ref(match.last_node, lock_id, rid=req.rid)
        return MatchResult(torch.cat((match.device_indices, loaded.to(match.device_indices.device))), node), new_lock

    def _run_prefill(self, batch: list[Req]) -> None:
        memory = self.memory
        rows = memory.req_to_token_pool
        if rows.alloc(batch) is None:
            raise RuntimeError(f"out of request rows: {rows.available_size()} free for {len(batch)} requests")
        memory.free_windows_before_extend(batch, self.window_hook)
        prefix_lens = [r.kv_committed_len for r in batch]
        extend_lens = [r.extend_len for r in batch]
        slots = self._alloc_extend(batch, prefix_lens, extend_lens)
        cursor = 0
        for req, prefix, extend in zip(batch, prefix_lens, extend_lens, strict=True):
            assert req.req_pool_idx is not None
            rows.write(req.req_pool_idx, 0, req.prefix_indices)
            rows.write(req.req_pool_idx, prefix, slots[cursor : cursor + extend])
            cursor += extend
        input_ids = np.concatenate(
            [r.all_ids()[p : p + e] for r, p, e in zip(batch, prefix_lens, extend_lens, strict=True)]
        )
        forward = ForwardBatch.build(
            "extend", torch.from_numpy(input_ids.astype(np.int64)), held_rows(batch), prefix_lens, slots, extend_lens
        )
        self._check_reads(batch, prefix_lens)
        if self.hicache is not None:
            self.hicache.controller.wait_loads_on_current_stream()  # NOTE: the loaded rows are read now
        logits = self.model.forward(forward, rows, memory.kv_pool)
        memory.allocator.free_group_begin()
        # NOTE: a chunk's row samples nothing (its generator draws only for real outputs)
        done = [i for i, r in enumerate(batch) if not r.is_chunked]
        chosen = dict(zip(done, choose_tokens([batch[i] for i in done], logits[done]), strict=True)) if done else {}
        for i, (req, row) in enumerate(zip(batch, logits, strict=True)):
            self._after_prefill(req, row, chosen.get(i))
        memory.allocator.free_group_end()

    def _alloc_extend(self, batch: list[Req], prefix_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
        memory, ps = self.memory, self.memory.page_size
        need = sum(extend_lens) + (len(batch) * ps if ps > 1 else 0)
        self.stats.evicted(memory.evict_for(need))
        allocator = memory.allocator
        with charged_to_batch(allocator, batch, extend_lens):
            if ps == 1:
                slots = allocator.alloc(sum(extend_lens))
            else:
                last = [int(r.prefix_indices[p - 1]) if p else -1 for r, p in zip(batch, prefix_lens, strict=True)]
                seq = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
                slots = allocator.alloc_extend(prefix_lens, seq, last, sum(extend_lens))
        if slots is None:
            raise RuntimeError(
                f"Prefill out of memory: {need} tokens needed, {memory.full_available()} available "
                f"after eviction (the admission budget should have prevented this)"
            )
        return slots

    def _after_prefill(self, req: Req, logits_row: torch.Tensor, token: int | None) -> None:
        req.kv_committed_len += req.extend_len
        req.fill_ids = req.all_ids()[: req.kv_committed_len]
        if self.on_logits is not None:
            self.on_logits(req, req.kv_committed_len - 1, logits_row)
        if req.is_chunked:
            self.memory.cache.cache_unfinished_req(req, chunked=True)
            self.chunked_req = req
            return
        if self.chunked_req is req:
            self.chunked_req = None
        assert token is not None  # NOTE: chosen for every request whose prompt is done
        req.append_output(token)
        self.stats.first_token(req, self.step)
        if req.is_done():
            self._finish(req)
            return
        self.memory.cache.cache_unfinished_req(req)
        req.state = ReqState.RUNNING
        self.running.append(req)

    def _check_reads(self, batch: list[Req], read_lens: list[int]) -> None:
        """Debug mode: every slot a request reads must be its own or the tree's."""
        if self.read_checker is None:
            return
        rows = self.memory.req_to_token_pool
        for req, read_len in zip(batch, read_lens, strict=True):
            assert req.req_pool_idx is not None
            if read_len:
                self.read_checker.check_reads(req.rid, rows.read(req.req_pool_idx, 0, read_len))

    # -- decode (docs/memory-semantics.md §9.3): memory check, retraction, window freeing, one slot per
    # request, forward, sampling, finish
    # NOTE: retraction order: requests sorted by (len(output), -len(prompt)) descending; victims
    # are popped from the end (fewest outputs first; among ties the longest prompt), always
    # keeping one. new_token_ratio decays by `decay` per successful check, and after a retraction
    # becomes min(1, (decoded + retract_decode_steps * n) / (Σ max_new + 1)) over those kept.

    def _run_decode(self) -> None:
        self._ensure_decode_memory()
        batch = self.running
        if not batch:
            return
        memory = self.memory
        memory.free_windows_for_decode(batch, self.sched.swa_eviction_interval, self.window_hook)
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
        chosen = choose_tokens(batch, logits)
        for req, row, token in zip(batch, logits, chosen, strict=True):
            req.kv_committed_len += 1
            req.decode_steps += 1
            if self.on_logits is not None:
                self.on_logits(req, req.kv_committed_len - 1, row)
            req.append_output(token)
            if req.is_done():
                self._finish(req)
            else:
                still_running.append(req)
        memory.allocator.free_group_end()
        self.running = still_running

    def _alloc_decode(self, batch: list[Req], row_ids: list[int], positions: list[int]) -> torch.Tensor:
        allocator = self.memory.allocator
        with charged_to_batch(allocator, batch, 1):
            if self.memory.page_size == 1:
                slots = allocator.alloc(len(batch))
            else:
                last = self.memory.req_to_token_pool.read_tokens(row_ids, [p - 1 for p in positions])
                slots = allocator.alloc_decode([p + 1 for p in positions], last)
        if slots is None:
            raise RuntimeError("Decode out of memory after the memory check (this is a kvscope bug)")
        return slots

    def _decode_need(self, reqs: list[Req]) -> int:
        ps = self.memory.page_size
        return ps * sum(1 for r in reqs if r.kv_committed_len % ps == 0)

    def _decode_fits(self, reqs: list[Req]) -> bool:
        memory = self.memory
        need = self._decode_need(reqs)
        self.stats.evicted(memory.evict_for(need))
        return memory.available_size() >= need

    def _ensure_decode_memory(self) -> None:
        if self._decode_fits(self.running):
            self.new_token_ratio = max(
                self.new_token_ratio - self.sched.new_token_ratio_decay, self.sched.min_new_token_ratio
            )
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
            self.stats.evicted(self.memory.evict_for(future))
            decoded = sum(len(r.output_ids) for r in keep)
            budget = sum(r.max_new_tokens for r in keep)
            self.new_token_ratio = min(1.0, (decoded + self.sched.retract_decode_steps * len(keep)) / (budget + 1))
        for req in reversed(retracted):
            self.waiting.appendleft(req)

    # -- leaving -------------------------------------------------------------------------------

    def _release(self, req: Req, is_insert: bool) -> None:
        """release_kv_cache (docs/memory-semantics.md §3.6): the cache takes or frees the KV, then the row goes."""
        memory = self.memory
        with charged_to(memory.allocator, req.rid):
            req.fill_ids = req.all_ids()
            memory.cache.cache_finished_req(req, is_insert=is_insert)
            memory.req_to_token_pool.free(req)

    def _finish(self, req: Req) -> None:
        faults = self.faults
        if faults is None:
            self._release(req, is_insert=True)
        else:
            fault_hooks.maybe_leak_tail(faults, self.memory, req)
            with fault_hooks.double_free_window(faults, self.memory, req):
                self._release(req, is_insert=True)
            fault_hooks.maybe_lock_leak(faults, self.memory, req)
        req.state = ReqState.FINISHED
        self.stats.finished(req, self.step)

    def _retract(self, req: Req) -> None:
        self._release(req, is_insert=False)
        req.reset_for_retract(self.memory.cache.root)
        self.stats.retracted(req, self.step)

    def abort_request(self, rid: str) -> bool:
        """A client gave up (as SGLang's abort_request): a waiting request just leaves; a running
        or half-prefilled one gives its KV back without inserting it. False if rid is unknown."""
        for req in self.waiting:  # a waiting request holds no KV (a retracted one gave it back)
            if req.rid == rid:
                self.waiting.remove(req)
                req.state = ReqState.ABORTED
                self.stats.aborted(req, self.step, "client abort")
                return True
        target = next((r for r in [*self.running, self.chunked_req] if r is not None and r.rid == rid), None)
        if target is None:
            return False
        if target is self.chunked_req:
            self.chunked_req = None
        self.memory.allocator.free_group_begin()
        self._abort(target, "client abort")
        self.memory.allocator.free_group_end()
        return True

    def _abort(self, req: Req, reason: str) -> None:
        self._release(req, is_insert=False)
        req.state = ReqState.ABORTED
        self.running = [r for r in self.running if r is not req]
        self.stats.aborted(req, self.step, reason)

    def __repr__(self) -> str:
        return (
            f"Scheduler(step={self.step}, waiting={len(self.waiting)}, running={len(self.running)}, "
            f"t={time.monotonic():.1f})"
        )
