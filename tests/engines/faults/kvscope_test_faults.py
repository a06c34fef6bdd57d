"""A test-only vLLM general plugin (tests/engines only; never installed, never shipped): it makes a
real vLLM 0.32 server mishandle the blocks of the requests the test marks, so the probe's census
can be checked against faults the test knows exactly.

How it is loaded: this directory holds the module and a `kvscope_test_faults-0.0.dist-info` with
its `vllm.general_plugins` entry point; the engine tests put the directory on the server's
PYTHONPATH and name the plugin in VLLM_PLUGINS, and importlib.metadata finds it there. Nothing is
installed into the vLLM venv. It is inert unless KVSCOPE_TEST_FAULTS_LOG names the file it logs
what it injected to (one JSON object a line: fault, rid, blocks); kvscope never reads that variable.

What it does (KVCacheManager.free of a finished request whose id holds the marker; the test sets
the id with the X-Request-Id header, which vLLM's server keeps inside its request ids)
    kvsfault-leak   the request's first block keeps an extra reference (ref_cnt + 1 behind the
                    block pool's back): it never returns to the free queue
    kvsfault-dfree  the request's blocks are freed twice (its block table put back after the
                    free and freed again): each ends with ref -1
Preemptions free through the same method; they are left alone (the request is not finished).
"""

from __future__ import annotations

import json
import os
from typing import Any

LOG_ENV = "KVSCOPE_TEST_FAULTS_LOG"
FAULTS = {"kvsfault-leak": "leak", "kvsfault-dfree": "double-free"}


def register() -> None:
    log = os.environ.get(LOG_ENV)
    if not log:
        return
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if getattr(KVCacheManager, "_kvscope_test_faults", False):
        return
    KVCacheManager.free = _faulty_free(KVCacheManager.free, log)
    KVCacheManager._kvscope_test_faults = True


def _fault(request: Any) -> str | None:
    if not request.is_finished():
        return None
    return next((fault for marker, fault in FAULTS.items() if marker in request.request_id), None)


def _faulty_free(original: Any, log: str) -> Any:
    def free(self: Any, request: Any) -> None:
        fault = _fault(request)
        if fault is None:
            return original(self, request)
        group = self.coordinator.single_type_managers[0]
        blocks = list(group.req_to_blocks.get(request.request_id, ()))
        if fault == "leak":
            injected = [b for b in blocks if not b.is_null][:1]
            for block in injected:
                block.ref_cnt += 1
            original(self, request)
        else:
            injected = [b for b in blocks if not b.is_null]
            original(self, request)
            group.req_to_blocks[request.request_id] = blocks
            original(self, request)  # NOTE: through the same method: the probe sees whom it is for
        with open(log, "a") as out:
            out.write(
                json.dumps({"fault": fault, "rid": request.request_id, "blocks": sorted(b.block_id for b in injected)})
                + "\n"
            )
        return None

    return free
