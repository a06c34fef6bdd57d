"""A test-only vLLM general plugin (tests/engines only; never installed, never shipped): it makes a
real vLLM 0.32 server mishandle the blocks of the requests the test marks, so the probe's census
can be checked against faults the test knows exactly.

How it is loaded: this directory holds the module and a `kvscope_test_faults-0.0.dist-info` with
its `vllm.general_plugins` entry point; the engine tests put the directory on the server's
PYTHONPATH and name the plugin in VLLM_PLUGINS, and importlib.metadata finds it there. Nothing is
installed into the vLLM venv. It is inert unless KVSCOPE_TEST_FAULTS_LOG names the file it logs
what it injected to (one JSON object a line: fault, rid, blocks, the probe's step when the probe
runs in the process, the wall time); kvscope never reads that variable.

A fault is selected by a marker in the request's id (the test sets it with the X-Request-Id
header, which vLLM's server keeps inside its request ids). Each is injected below the probe, in
vLLM's own classes, at a call the probe does not wrap, so whichever plugin patches first the probe
sees exactly the calls the faulty engine makes:
    kvsfault-leak    (KVCacheManager.free of a finished request) its first block keeps an extra
                     reference behind the block pool's back: it never returns to the free queue
    kvsfault-dfree   (same) its blocks are freed twice: each ends with ref -1
    kvsfault-linger  (Scheduler._free_request of an aborted request) its blocks are kept, as
                     vLLM's delayed free for a remote-KV load does (vLLM #46283: the completion
                     never comes): the request stays in the scheduler's table, finished, and its
                     blocks are never freed (the symptom of vLLM #27073, usage that stays high)
    kvsfault-stray   (KVCacheCoordinator.allocate_new_blocks, inside KVCacheManager.allocate_slots
                     for the request) STRAY_BLOCKS more blocks are taken from the pool and kept by
                     nobody's block table, never freed
    kvsfault-noref   (KVCacheCoordinator.allocate_new_computed_blocks) each prefix-cache hit of the
                     request joins its block table without a reference (the pool's touch is
                     skipped: vLLM #37076); when the request's blocks are freed (its end or a
                     preemption) the unreferenced ones are left out of the free, so the counts
                     agree again and the engine lives on. A line "noref-ended" says when: each
                     pair of lines is a stretch of steps in which the census must see the fault
    kvsfault-pdfree  (KVCacheManager.free of a request being preempted, the first one in this
                     process) its cached blocks that the free returned to the queue are freed once
                     more, through the same method: each sits in the free queue at ref -1 until
                     vLLM hands one out again, and its own `assert block.ref_cnt == 0` kills the
                     EngineCore. Nothing is checked after it: a test uses it last.
Each is injected once per request (kvsfault-noref at each hit, kvsfault-pdfree once per process);
a request without blocks to mishandle is left alone and logs nothing.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

LOG_ENV = "KVSCOPE_TEST_FAULTS_LOG"
FAULTS = {"kvsfault-leak": "leak", "kvsfault-dfree": "double-free"}
LINGER, STRAY, NOREF, PREEMPT_DFREE = "kvsfault-linger", "kvsfault-stray", "kvsfault-noref", "kvsfault-pdfree"
STRAY_BLOCKS = 2


class _Fired:
    """What this process injected so far (the engine runs its scheduler on one thread)."""

    def __init__(self) -> None:
        self.rids: set[tuple[str, str]] = set()  # (fault, rid)
        self.preempt_dfree = False
        self.kept: list[Any] = []  # the stray blocks: referenced by nothing but this list
        self.unreferenced: dict[str, list[Any]] = {}  # rid -> hit blocks it holds without a reference

    def once(self, fault: str, rid: str) -> bool:
        if (fault, rid) in self.rids:
            return False
        self.rids.add((fault, rid))
        return True


FIRED = _Fired()


def register() -> None:
    log = os.environ.get(LOG_ENV)
    if not log:
        return
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(KVCacheManager, "_kvscope_test_faults", False):
        return
    KVCacheManager.free = _faulty_free(KVCacheManager.free, log)
    Scheduler._free_request = _lingering_free(Scheduler._free_request, log)
    KVCacheCoordinator.allocate_new_blocks = _stray_alloc(KVCacheCoordinator.allocate_new_blocks, log)
    KVCacheCoordinator.allocate_new_computed_blocks = _unreferenced_hit(
        KVCacheCoordinator.allocate_new_computed_blocks, log
    )
    KVCacheCoordinator.free = _free_unreferenced(KVCacheCoordinator.free, log)
    KVCacheManager._kvscope_test_faults = True


def _write(log: str, fault: str, rid: str, blocks: list[Any], **more: Any) -> None:
    record = {
        "fault": fault,
        "rid": rid,
        "blocks": sorted(b.block_id for b in blocks),
        "step": _probe_step(),
        "time": time.time(),
        "mono": time.monotonic(),  # NOTE: the capture's clock (t_mono): one system-wide monotonic clock
        **more,
    }
    with open(log, "a") as out:
        out.write(json.dumps(record) + "\n")


def _probe_step() -> int | None:
    """The probe's engine step now (the step the fault happens in), None without a probe."""
    try:
        from kvscope.probe.vllm import PROBE
    except ImportError:
        return None
    step = getattr(PROBE, "step", None)
    return int(step) if PROBE.state.active and step is not None else None


def _own(blocks: Any) -> list[Any]:
    return [b for b in blocks if not b.is_null]


def _fault(request: Any) -> str | None:
    rid = request.request_id
    if not request.is_finished():
        return "preempt-double-free" if PREEMPT_DFREE in rid and not FIRED.preempt_dfree else None
    return next((fault for marker, fault in FAULTS.items() if marker in rid), None)


def _faulty_free(original: Any, log: str) -> Any:
    def free(self: Any, request: Any) -> None:
        fault = _fault(request)
        if fault is None:
            return original(self, request)
        group = self.coordinator.single_type_managers[0]
        rid = request.request_id
        blocks = list(group.req_to_blocks.get(rid, ()))
        if fault == "leak":
            injected = _own(blocks)[:1]
            for block in injected:
                block.ref_cnt += 1
            original(self, request)
        elif fault == "double-free":
            injected = _own(blocks)
            original(self, request)
            group.req_to_blocks[rid] = blocks
            original(self, request)  # NOTE: through the same method: the probe sees whom it is for
        else:
            original(self, request)
            # NOTE: the cached blocks only: they go to the queue's tail, so vLLM hands them out again (and
            # asserts) some steps later; the uncached ones at its head would be taken back this very step
            injected = [b for b in _own(blocks) if b.block_hash is not None and b.ref_cnt == 0]
            if not injected:
                return None
            FIRED.preempt_dfree = True
            group.req_to_blocks[rid] = injected
            original(self, request)
        _write(log, fault, rid, injected)
        return None

    return free


def _lingering_free(original: Any, log: str) -> Any:
    def _free_request(self: Any, request: Any, delay_free_blocks: bool = False) -> Any:
        rid = request.request_id
        if LINGER in rid and request.status.name == "FINISHED_ABORTED" and not delay_free_blocks:
            blocks = _own(self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.get(rid, ()))
            if blocks and FIRED.once("linger", rid):
                result = original(self, request, delay_free_blocks=True)
                _write(log, "linger", rid, blocks, status=request.status.name)
                return result
        return original(self, request, delay_free_blocks=delay_free_blocks)

    return _free_request


def _stray_alloc(original: Any, log: str) -> Any:
    def allocate_new_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request_id, *args, **kwargs)
        pool = self.block_pool
        if STRAY in request_id and pool.get_num_free_blocks() >= STRAY_BLOCKS and FIRED.once("stray", request_id):
            taken = pool.get_new_blocks(STRAY_BLOCKS)  # NOTE: inside allocate_slots: the probe's context is the request
            FIRED.kept.extend(taken)
            _write(log, "stray", request_id, taken)
        return result

    return allocate_new_blocks


def _unreferenced_hit(original: Any, log: str) -> Any:
    def allocate_new_computed_blocks(
        self: Any, request_id: str, new_computed_blocks: Any, *args: Any, **kwargs: Any
    ) -> Any:
        hits = [b for group in new_computed_blocks for b in _own(group)]
        if NOREF not in request_id or not hits:
            return original(self, request_id, new_computed_blocks, *args, **kwargs)
        pool = self.block_pool
        pool.touch = _no_touch  # NOTE: this pool object only, this call only: the class's touch is never called
        try:
            result = original(self, request_id, new_computed_blocks, *args, **kwargs)
        finally:
            del pool.touch
        FIRED.unreferenced[request_id] = hits
        _write(log, "noref", request_id, hits)
        return result

    return allocate_new_computed_blocks


def _no_touch(blocks: Any) -> None:
    return None


def _free_unreferenced(original: Any, log: str) -> Any:
    def free(self: Any, request_id: str) -> None:
        unreferenced = FIRED.unreferenced.pop(request_id, None)
        if unreferenced:
            for manager in self.single_type_managers:
                table = manager.req_to_blocks.get(request_id)
                for block in unreferenced if table is not None else ():
                    # NOTE: one entry each: the request may hold the same block again, taken anew with a reference
                    at = next((i for i, b in enumerate(table) if b is block), None)
                    if at is not None:
                        del table[at]
            _write(log, "noref-ended", request_id, unreferenced)
        return original(self, request_id)

    return free
