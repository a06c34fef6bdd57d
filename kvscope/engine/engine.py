"""The engine: a model, its memory system and the scheduler, fed with requests.

Requests arrive all at once, or paced in real time (`pace_per_s`) so a dashboard can watch
the memory fill and drain. Whenever the engine is fully idle it runs the leak check.
`step` is the one scheduler code path: `run` loops over it with its arrivals and pacing, the
`kvscope serve` scheduler process (kvscope.server.scheduler) over `step_once`, which also names
the requests whose output changed, with requests from ZMQ.

It writes to the recorder it is given and never reads a capture back; a read checker, when
given, sees every slot a forward is about to read (both come from the caller, by interface).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from kvscope.engine import fault_hooks
from kvscope.engine.cache_kinds import cache_kind
from kvscope.engine.config import EngineConfig
from kvscope.engine.faults import FaultInjector, FaultSpec, check_applicable
from kvscope.engine.memory import HiMemorySystem, MemorySystem, build_memory
from kvscope.engine.model import ModelConfig, TinyTransformer, kv_pool_shape
from kvscope.engine.read_check import ReadChecker
from kvscope.engine.request import Req, ReqState
from kvscope.engine.scheduler import LogitsHook, Scheduler
from kvscope.engine.stats import EngineStalled, EngineStats
from kvscope.mem import resolve_device
from kvscope.telemetry import NULL_RECORDER, FaultKind, Recorder

ENDED = (ReqState.FINISHED, ReqState.ABORTED)
STALL_STEPS = 8  # steps in a row with nothing admitted or running before a batch run gives up
ProgressHook = Callable[[EngineStats, int], None]  # (stats, requests submitted so far)


def check_faults(config: EngineConfig, model_config: ModelConfig, faults: list[FaultSpec]) -> None:
    if not faults:
        return
    if config.strict:
        raise ValueError("fault injection needs strict mode off (strict mode stops each fault where it happens)")
    spec = cache_kind(config.cache.kind)
    check_applicable(faults, has_tree=spec.has_tree, is_swa=model_config.is_hybrid, has_host=spec.has_host)


def check_request(config: EngineConfig, model_config: ModelConfig, req: Req) -> None:
    """A request that can never run is a clear error before the run starts."""
    pool = config.pool
    total = req.prompt_len + req.max_new_tokens
    if total > pool.max_context_len:
        raise ValueError(
            f"request {req.rid}: {total} tokens (prompt + output) exceed the context length {pool.max_context_len}"
        )
    need = -(-total // pool.page_size) * pool.page_size + pool.page_size
    if need > pool.full_size_tokens:
        raise ValueError(
            f"KV capacity {pool.full_size_tokens} tokens is smaller than one request ({req.rid} needs {need})"
        )
    if int(np.max(req.prompt_ids)) >= model_config.vocab_size:
        raise ValueError(
            f"request {req.rid}: token id {int(np.max(req.prompt_ids))} outside the model's "
            f"vocabulary of {model_config.vocab_size}"
        )


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        recorder: Recorder = NULL_RECORDER,
        on_logits: LogitsHook | None = None,
        *,
        read_checker: ReadChecker | None = None,
        faults: list[FaultSpec] | None = None,
        fault_seed: int = 0,
    ) -> None:
        """`read_checker`: sees the KV pool once built, then every slot a request is about to read
        (the debugger's monitor catches a use-after-free at the read; it is usually the recorder
        too). `faults`: inject these faults (needs strict mode off)."""
        config.check_model(model_config.sliding_window, model_config.is_hybrid, model_config)
        check_faults(config, model_config, faults or [])
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        if config.torch_threads is not None:
            import torch

            torch.set_num_threads(config.torch_threads)  # NOTE: for the whole process, which the engine owns
        self.recorder = recorder
        self.read_checker = read_checker
        self.model = TinyTransformer(model_config, self.device)
        self.memory: MemorySystem = build_memory(
            config, kv_pool_shape(model_config), model_config.sliding_window, recorder
        )
        if read_checker is not None:
            read_checker.attach_kv_pool(self.memory.kv_pool)
        self.faults = FaultInjector(faults, fault_seed, recorder) if faults else None
        if self.faults is not None and FaultKind.HOST_LEAK in self.faults.rates:
            assert isinstance(self.memory, HiMemorySystem)  # check_faults: host-leak needs hiradix
            self.memory.cache.on_host_free = partial(fault_hooks.maybe_host_leak, self.faults)
        self.scheduler = Scheduler(
            config, self.model, self.memory, recorder, on_logits, read_checker=read_checker, faults=self.faults
        )
        self._last_check_step = -1  # the step of the last idle check

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    def validate(self, req: Req) -> None:
        check_request(self.config, self.model_config, req)

    def submit(self, req: Req) -> None:
        self.validate(req)
        self.scheduler.add_request(req)

    def step(self) -> None:
        """One scheduler step, or the idle leak check when nothing is in flight (once per idle
        point, however long it lasts). `run` and the serve scheduler process both drive the
        engine through this one call (serve through step_once)."""
        if self.scheduler.is_idle():
            self.idle_check()
        else:
            self.scheduler.run_step()

    def step_once(self) -> list[Req]:
        """step(), and the requests whose output grew or that ended in it (what serve streams)."""
        scheduler = self.scheduler
        if scheduler.is_idle():
            self.idle_check()
            return []
        # NOTE: only these can change: a step admits from the head of the queue, at most a batch
        queue_head = scheduler.prefill_candidates()
        chunked = [scheduler.chunked_req] if scheduler.chunked_req is not None else []
        before = [(r, len(r.output_ids)) for r in (*scheduler.running, *chunked, *queue_head)]
        self.step()
        return [r for r, num_outputs in before if len(r.output_ids) != num_outputs or r.state in ENDED]

    def flush_cache(self) -> bool:
        """SGLang's flush_cache: with no request running or waiting, every cached token leaves the
        prefix cache (each leaf evicted and recorded as an eviction is); otherwise nothing
        changes and the answer is False."""
        if not self.scheduler.is_idle():
            return False
        self.memory.evict_all()
        return True

    def idle_check(self) -> bool:
        """The idle leak check, once per idle point; True when it ran now."""
        scheduler = self.scheduler
        if self._last_check_step == scheduler.step:
            return False
        self._last_check_step = scheduler.step
        scheduler.on_idle()
        self.recorder.idle()
        return True

    def run(
        self,
        requests: Sequence[Req],
        pace_per_s: float | None = None,
        progress: ProgressHook | None = None,
        max_steps: int | None = None,
    ) -> EngineStats:
        """Run until every request has finished (or aborted); the leak check runs at idle points."""
        for req in requests:
            self.validate(req)
        start = time.monotonic()
        arrivals = [start + i / pace_per_s if pace_per_s else start for i in range(len(requests))]
        submitted = 0
        scheduler = self.scheduler
        while True:
            now = time.monotonic()
            while submitted < len(requests) and arrivals[submitted] <= now:
                scheduler.add_request(requests[submitted])
                submitted += 1
            if scheduler.is_idle():
                self.step()  # the idle check
                if submitted == len(requests):
                    break
                time.sleep(max(0.0, arrivals[submitted] - time.monotonic()))
                continue
            self.step()
            if scheduler.stalled_steps >= STALL_STEPS:
                raise EngineStalled(self.stall_message())
            if progress is not None:
                progress(self.stats, submitted)
            if max_steps is not None and scheduler.step >= max_steps:
                break
        self.finish_run()
        return self.stats

    def stall_message(self) -> str:
        """One line: why no waiting request can start."""
        scheduler, memory = self.scheduler, self.memory
        head = scheduler.waiting[0] if scheduler.waiting else None
        full = memory.full_terms()
        need = f"the next ({head.rid}) needs {head.all_len} tokens; " if head is not None else ""
        return (
            f"stalled at step {scheduler.step}: {len(scheduler.waiting)} requests wait and none can start, none "
            f"runs: {need}the pool has {full.available} free and {full.evictable} evictable of {full.total}, and "
            f"{full.protected} stay locked with no request running (a lock that is never released?)"
        )

    def finish_run(self) -> None:
        """The end of a run: the tree's last snapshot; requests still open get 'unfinished' rows."""
        if self.recorder.summary_enabled:
            self.scheduler.snapshot()
        self.stats.host_tier = self.memory.host_totals()
        self.stats.close_unfinished()

    def check_integrity(self) -> None:
        """Every pool and the cache conserve, given the slots running requests own."""
        memory, scheduler = self.memory, self.scheduler
        memory.cache.check_integrity()
        holders = [*scheduler.running, *([scheduler.chunked_req] if scheduler.chunked_req else [])]
        owned = [memory.cache.tree_slots()]
        for req in holders:
            assert req.req_pool_idx is not None
            owned.append(
                memory.req_to_token_pool.read(req.req_pool_idx, req.cache_protected_len, req.kv_committed_len)
                .cpu()
                .numpy()
            )
        memory.allocator.check_integrity(np.concatenate(owned))
        memory.req_to_token_pool.check_integrity([r.req_pool_idx for r in holders if r.req_pool_idx])
