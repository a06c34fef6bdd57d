"""Drives the probe against vLLM's real BlockPool / KVCacheManager in one process (no server).
Run with the vLLM venv's python, kvscope on PYTHONPATH:

    python vllm_probe_driver.py SCENARIO      (clean, extra-ref, double-free, unknown-version,
                                               missing-target, inert)

The environment names the capture (KVSCOPE_CAPTURE, KVSCOPE_PYTHON). Prints one JSON line: what the
probe said, the census results, the injected ground truth, and that vLLM's own calls still worked.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from kvscope.probe import vllm as probe

BLOCK = 16
NUM_BLOCKS = 12


def manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return KVCacheManager(config, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=True, log_stats=True)


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def serve(kv: KVCacheManager, live: dict[str, Request], rid: str, tokens: list[int]) -> Request:
    """One request's prefill the way the scheduler drives it: lookup, allocate, cache."""
    req = request(rid, tokens)
    live[rid] = req
    blocks, num_hit, _ = kv.get_computed_blocks(req)
    kv.allocate_slots(req, len(tokens) - num_hit, num_hit, blocks)
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req, len(tokens))
    return req


def finish(kv: KVCacheManager, live: dict[str, Request], req: Request) -> None:
    req.status = RequestStatus.FINISHED_STOPPED
    probe._record_request(req)
    kv.free(req)
    del live[req.request_id]


def idle(kv: KVCacheManager, live: dict[str, Request]) -> dict:
    probe.PROBE.busy = True
    result = probe.PROBE.census(kv, set(live), [])
    return {} if result is None else {"ok": result.ok, "leaked": sorted(result.leaked), "lostref":
                                      sorted(result.lostref), "culprits": {str(b): c[0] for b, c in
                                                                          result.culprits.items()}}


def main(scenario: str) -> None:
    init_none_hash(sha256)
    said = ""
    if scenario == "unknown-version":
        said = probe._register(version="0.31.9")
    elif scenario == "missing-target":
        table = {"0.32.0": lambda: [*probe.targets(), probe.Target(probe.BLOCK_POOL, "BlockPool", "gone_in_0_33",
                                                                   probe._touch)]}
        said = probe._register(version="0.32.0", table=table)
    else:
        said = probe._register()
    kv, live, censuses, injected = manager(), {}, [], []
    shared = list(range(1000, 1000 + 2 * BLOCK))
    for rid, tail in [("req-a", 1), ("req-b", 2), ("req-c", 3)]:
        probe.PROBE.step_begins()
        req = serve(kv, live, rid, shared + [tail] * (BLOCK + 3))
        table = kv.coordinator.single_type_managers[0].req_to_blocks
        held = list(table[rid])
        finish(kv, live, req)
        if scenario == "extra-ref" and rid == "req-b":  # vLLM keeps one reference of a finished request
            with probe_context(rid):
                kv.block_pool.touch([held[-1]])
            injected.append({"kind": "extra-ref", "block": held[-1].block_id, "rid": rid})
        if scenario == "double-free" and rid == "req-b":  # a live request's block is released once more
            serve(kv, live, "req-hold", shared + [9] * 3)
            victim = table["req-hold"][0]
            with probe_context("req-hold"):
                kv.block_pool.free_blocks([victim])
            injected.append({"kind": "double-free", "block": victim.block_id, "rid": "req-hold"})
        censuses.append(idle(kv, live))
    # what GET /kvscope/census answers for this engine (the utility method the probe adds to EngineCore)
    engine = SimpleNamespace(scheduler=SimpleNamespace(kv_cache_manager=kv, deferred_frees=[], requests=live),
                             vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=0)))
    utility = getattr(EngineCore, "kvscope_census", None)
    live_census = utility(engine) if utility is not None else None
    # vLLM still works after whatever the probe did: a fresh request is served
    served = serve(kv, live, "after", [7] * (2 * BLOCK)).request_id in live
    rec = probe.PROBE.state.recorder
    if hasattr(rec, "close"):
        rec.close()
    print(json.dumps({"said": said, "active": probe.PROBE.state.active, "patched":
                      hasattr(type(kv.block_pool).touch, "__wrapped__"), "censuses": censuses,
                      "injected": injected, "served": served, "live": live_census}))


class probe_context:
    """The block pool works for `rid` inside (as the manager's wrappers set it)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def __enter__(self) -> None:
        self.saved = probe.PROBE.ctx.rid
        probe.PROBE.ctx.rid = self.rid

    def __exit__(self, *exc: object) -> None:
        probe.PROBE.ctx.rid = self.saved


if __name__ == "__main__":
    main(sys.argv[1])
