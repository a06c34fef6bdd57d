"""Drives the test-only fault plugin (tests/engines/faults) on vLLM's real KVCacheManager and block
pool in one process, without a server and without the probe, to check that each fault does to the
pool exactly what its log line says. Run with the vLLM venv's python, the faults directory and the
repository on PYTHONPATH, KVSCOPE_TEST_FAULTS_LOG set:

    python faults_driver.py

Prints one JSON line: per fault, the log line and what the pool holds after it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import kvscope_test_faults as faults
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

BLOCK = 16
NUM_BLOCKS = 24


def manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    return KVCacheManager(
        config, max_model_len=512, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
    )


def serve(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """A request's prefill as the scheduler drives it (lookup, allocate, cache); left running."""
    req = Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    req.status = RequestStatus.RUNNING
    blocks, num_hit, _ = kv.get_computed_blocks(req)
    kv.allocate_slots(req, len(tokens) - num_hit, num_hit, blocks)
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req, len(tokens))
    return req


def table(kv: KVCacheManager) -> dict[str, list[int]]:
    tables = kv.coordinator.single_type_managers[0].req_to_blocks
    return {rid: [b.block_id for b in blocks if not b.is_null] for rid, blocks in tables.items() if blocks}


def refs(kv: KVCacheManager, ids: list[int]) -> list[int]:
    return [kv.block_pool.blocks[b].ref_cnt for b in ids]


def queued(kv: KVCacheManager) -> set[int]:
    return {b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()}


def logged(fault: str) -> list[dict[str, Any]]:
    with open(os.environ[faults.LOG_ENV]) as log:
        return [line for line in map(json.loads, log) if line["fault"] == fault]


def stray() -> dict[str, Any]:
    kv = manager()
    serve(kv, "kvsfault-stray-1", list(range(3, 3 + 2 * BLOCK)))
    [line] = logged("stray")
    held = {b for blocks in table(kv).values() for b in blocks}
    return {"line": line, "refs": refs(kv, line["blocks"]), "in_a_table": sorted(held & set(line["blocks"]))}


def noref() -> dict[str, Any]:
    kv = manager()
    prefix = list(range(100, 100 + 2 * BLOCK))
    holder = serve(kv, "holder", [*prefix, 1, 2, 3])
    hit = serve(kv, "kvsfault-noref-1", [*prefix, 7, 8, 9])
    [line] = logged("noref")
    during = {"refs": refs(kv, line["blocks"]), "table": table(kv)["kvsfault-noref-1"]}
    hit.status = RequestStatus.FINISHED_STOPPED
    kv.free(hit)
    [ended] = logged("noref-ended")
    after_hit = refs(kv, line["blocks"])
    holder.status = RequestStatus.FINISHED_STOPPED
    kv.free(holder)
    pool = kv.block_pool
    return {
        "line": line,
        "ended": ended,
        "during": during,
        "after_hit": after_hit,
        "after_all": refs(kv, line["blocks"]),
        "all_free": pool.get_num_free_blocks() == pool.num_gpu_blocks - 1,
    }


def pdfree() -> dict[str, Any]:
    kv = manager()
    first = serve(kv, "kvsfault-pdfree-1", list(range(200, 200 + 3 * BLOCK + 5)))  # 3 cached blocks, 1 partial
    kv.free(first)  # NOTE: running: a preemption's free
    second = serve(kv, "kvsfault-pdfree-2", list(range(300, 300 + 2 * BLOCK + 5)))
    blocks = table(kv)["kvsfault-pdfree-2"]
    kv.free(second)  # NOTE: the fault comes once per process
    [line] = logged("preempt-double-free")
    return {
        "line": line,
        "refs": refs(kv, line["blocks"]),
        "queued": sorted(queued(kv) & set(line["blocks"])),
        "hashed": [kv.block_pool.blocks[b].block_hash is not None for b in line["blocks"]],
        "second_refs": refs(kv, blocks),
    }


def main() -> None:
    init_none_hash(sha256)
    faults.register()
    print(json.dumps({"stray": stray(), "noref": noref(), "pdfree": pdfree()}))


if __name__ == "__main__":
    main()
