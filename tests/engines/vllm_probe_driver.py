"""Drives the probe against vLLM's real BlockPool / KVCacheManager in one process (no server).
Run with the vLLM venv's python, kvscope on PYTHONPATH:

    python vllm_probe_driver.py SCENARIO      (clean, extra-ref, double-free, untested-version,
                                               changed-shape, missing-target, inert, life, refs, shutdown, crash,
                                               polled-crash, reused-parent, churn; on vLLM's real Scheduler
                                               (vllm_sched_driver.py): busy, linger, unpinned,
                                               preempt-free, deferred)

The environment names the capture (KVSCOPE_CAPTURE, KVSCOPE_PYTHON). Prints one JSON line: what the
probe said, the census results, the injected ground truth, and that vLLM's own calls still worked.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import torch
from vllm.config import CacheConfig, ParallelConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from kvscope.probe import vllm as probe
from kvscope.probe import vllm_hooks
from tests.engines.vllm_sched_driver import SCHEDULED, scheduled

BLOCK = 16
NUM_BLOCKS = 12


def manager(use_eagle: bool = False) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    return KVCacheManager(
        config,
        max_model_len=256,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
        log_stats=True,
        use_eagle=use_eagle,
    )


def request(rid: str, tokens: list[int]) -> Request:
    return Request(
        rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BLOCK, sha256)
    )


def serve(kv: KVCacheManager, live: dict[str, Request], rid: str, tokens: list[int]) -> Request:
    """One request's prefill the way the scheduler drives it: lookup, allocate, cache."""
    req = request(rid, tokens)
    live[rid] = req
    blocks, num_hit, _ = kv.get_computed_blocks(req)
    kv.allocate_slots(req, len(tokens) - num_hit, num_hit, blocks)
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req, len(tokens))
    return req


def finish(
    kv: KVCacheManager, live: dict[str, Request], req: Request, status: RequestStatus = RequestStatus.FINISHED_STOPPED
) -> None:
    req.status = status
    probe.PROBE.record_request(req)
    kv.free(req)
    del live[req.request_id]


def scheduler_of(kv: KVCacheManager, live: dict[str, Request]) -> SimpleNamespace:
    """What the census reads of a Scheduler, for a driver that calls the manager itself."""
    return SimpleNamespace(kv_cache_manager=kv, requests=live, deferred_frees=[])


def idle(kv: KVCacheManager, live: dict[str, Request]) -> dict:
    probe.PROBE.busy = True
    result = probe.PROBE.idle_edge(scheduler_of(kv, live))
    return (
        {}
        if result is None
        else {
            "ok": result.ok,
            "leaked": sorted(result.leaked),
            "lostref": sorted(result.lostref),
            "culprits": {str(b): c[0] for b, c in result.culprits.items()},
        }
    )


def step_ends(kv: KVCacheManager, live: dict[str, Request]) -> int:
    """The usage sample of a step, as EngineCoreProc's wrapper takes it; returns the cached-free
    blocks counted the slow way (hashed, ref 0, in the free queue) for the test to compare."""
    probe.PROBE.step_ends(SimpleNamespace(kv_cache_manager=kv, running=list(live.values()), waiting=[]))
    queued = {b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()}
    return sum(1 for b in kv.block_pool.blocks if b.block_hash is not None and b.block_id in queued)


def life() -> dict:
    """One of each: every lookup stop reason, an allocation with no room, an aborted request, a
    snapshot with a live holder; the engine is DP rank 1 of a dense model (vLLM resets its
    data_parallel_rank to 0 and keeps the rank in data_parallel_index)."""
    parallel = ParallelConfig()
    parallel.data_parallel_index = 1
    parallel.reconfigure_for_independent_dp_rank()
    probe.PROBE.engine_seen(
        SimpleNamespace(
            vllm_config=SimpleNamespace(parallel_config=parallel, cache_config=CacheConfig(block_size=BLOCK))
        )
    )
    kv, live, cached_free = manager(), {}, []
    p32, other = list(range(2000, 2000 + 2 * BLOCK)), list(range(3000, 3000 + 3 * BLOCK))
    prompts = [
        ("short", [5] * 10),
        ("p40", other[:40]),
        ("again40", other[:40]),
        ("p32", p32),
        ("again32", p32),
        ("fork48", p32[:BLOCK] + [6] * (2 * BLOCK)),
    ]
    for rid, tokens in prompts:  # miss, short, partial, capped, diverged (p40 and p32 miss)
        probe.PROBE.step_begins()
        req = serve(kv, live, rid, tokens)
        finish(
            kv, live, req, RequestStatus.FINISHED_ABORTED if rid == "short" else RequestStatus.FINISHED_LENGTH_CAPPED
        )
        cached_free.append(step_ends(kv, live))
    probe.PROBE.step_begins()
    held = serve(kv, live, "held", p32 + [8] * BLOCK)  # holds p32's two cached blocks and a third
    big = request("big", [9] * (10 * BLOCK))  # 10 blocks: only 8 left
    live["big"] = big
    blocks, num_hit, _ = kv.get_computed_blocks(big)
    no_room = kv.allocate_slots(big, 10 * BLOCK - num_hit, num_hit, blocks) is None
    del live["big"]
    manager(use_eagle=True).get_computed_blocks(request("eagle", p32 + [4] * 3))  # a layout the reasons do not model
    cached_free.append(step_ends(kv, live))
    census = idle(kv, live)
    chain = [b.block_id for b in kv.coordinator.single_type_managers[0].req_to_blocks["held"]]
    return {
        "census": census,
        "cached_free": cached_free,
        "no_room": no_room,
        "held": chain,
        "free_blocks": kv.block_pool.get_num_free_blocks(),
        "held_rid": held.request_id,
    }


def refs() -> dict:
    """Every way a block-pool call changes ref counts, over two steps: a free that leaves shared
    blocks held (unlock) beside blocks at ref 0 (free), a free of all-ref-0 blocks, cached blocks
    revived from the free queue, an allocation that evicts cached-free ones; then vLLM's own ref
    counts, for the test to replay the capture's events against."""
    kv, live, steps = manager(), {}, []
    shared = list(range(4000, 4000 + 3 * BLOCK))
    probe.PROBE.step_begins()
    first = serve(kv, live, "r1", shared + [1] * BLOCK)  # 4 full blocks, all cached
    second = serve(kv, live, "r2", shared + [2] * BLOCK)  # touches r1's first 3, allocates 1
    finish(kv, live, first)  # 3 still held by r2 (unlock), 1 at ref 0 (free)
    step_ends(kv, live)
    steps.append(probe.PROBE.step)
    probe.PROBE.step_begins()
    finish(kv, live, second)  # all 4 at ref 0
    serve(kv, live, "r3", shared + [3] * 5)  # revives the 3 shared blocks from the free queue
    serve(kv, live, "r4", [7] * (6 * BLOCK + 5))  # 7 blocks of the 7 free: evicts the 2 cached-free ones
    step_ends(kv, live)
    steps.append(probe.PROBE.step)
    return {
        "refs": {str(b.block_id): b.ref_cnt for b in kv.block_pool.blocks if not b.is_null},
        "steps": steps,
        "free_blocks": kv.block_pool.get_num_free_blocks(),
    }


def evict_first() -> dict:
    """vLLM 0.34's free_blocks(..., evict_first=True) (blocks another tier holds): a request's cached
    blocks go to the free queue's front, not through append_n. The probe's cached-free count against
    the slow count (hashed, ref 0, queued), after an ordinary free and after an evict-first one."""
    kv, live = manager(), {}
    counts = []
    for rid, evict in (("r1", False), ("r2", True)):
        probe.PROBE.step_begins()
        serve(kv, live, rid, list(range(len(rid) * 5000, len(rid) * 5000 + 3 * BLOCK + 1)) if evict else [1] * 49)
        table = kv.coordinator.single_type_managers[0].req_to_blocks.pop(rid)
        del live[rid]
        with probe_context(rid):
            kv.block_pool.free_blocks(reversed(table), evict_first=evict)
        slow = step_ends(kv, live)
        counts.append({"probe": probe.PROBE.cached_free, "slow": slow})
    census = idle(kv, live)
    probe.PROBE.state.recorder.close()
    return {"counts": counts, "census": census}


def main(scenario: str) -> None:
    init_none_hash(sha256)
    said = ""
    if scenario in SCHEDULED:
        print(json.dumps(scheduled(scenario)))
        return
    if scenario == "untested-version":  # NOTE: a release no family lists, whose code is this one's
        said = probe._register(version="0.99.0")
    elif scenario == "changed-shape":  # NOTE: this release's code with one target's parameter renamed
        touch = BlockPool.touch

        def renamed(self: BlockPool, block_ids: list) -> None:
            touch(self, block_ids)

        BlockPool.touch = renamed  # type: ignore[method-assign]
        said = probe._register()
    elif scenario == "missing-target":  # NOTE: the shapes match, a target the family builds is gone
        chosen = probe.choose(probe.ENGINE_NAME, probe.vllm_version(), probe.FAMILIES).family
        assert chosen is not None
        gone = probe.Target(probe.BLOCK_POOL, "BlockPool", "gone_in_0_35", vllm_hooks._touch)
        said = probe._register(families=[chosen._replace(build=lambda: [*chosen.build(), gone])])
    else:
        said = probe._register()
    if scenario == "reused-parent":
        print(json.dumps({"said": said, **reused_parent()}))
        return
    if scenario == "polled-crash":
        print(json.dumps({"said": said, **polled_then_crash()}))
        return
    if scenario in ("shutdown", "crash"):
        print(json.dumps({"said": said, **engine_ends(scenario == "crash")}))
        return
    if scenario == "churn":
        print(json.dumps({"said": said, **churn()}))
        return
    if scenario == "evict-first":
        print(json.dumps({"said": said, **evict_first()}))
        return
    if scenario in ("life", "refs"):
        result = life() if scenario == "life" else refs()
        probe.PROBE.state.recorder.close()
        print(json.dumps({"said": said, "plugins": os.environ.get("VLLM_PLUGINS"), **result}))
        return
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
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(kv_cache_manager=kv, deferred_frees=[], requests=live),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=0)),
    )
    utility = getattr(EngineCore, "kvscope_census", None)
    live_census = utility(engine) if utility is not None else None
    # vLLM still works after whatever the probe did: a fresh request is served
    served = serve(kv, live, "after", [7] * (2 * BLOCK)).request_id in live
    rec = probe.PROBE.state.recorder
    if hasattr(rec, "close"):
        rec.close()
    print(
        json.dumps(
            {
                "said": said,
                "active": probe.PROBE.state.active,
                "patched": hasattr(type(kv.block_pool).touch, "__wrapped__"),
                "censuses": censuses,
                "injected": injected,
                "served": served,
                "live": live_census,
            }
        )
    )


def engine_ends(crash: bool) -> dict:
    """A request served, then the engine's loop ends the way run_engine_core sees it: SystemExit at a
    normal shutdown, or vLLM's own error (the block pool asked for more blocks than it has); either
    way vLLM's EngineCore.shutdown runs in the `finally`, with the exception still in flight."""
    kv, live = manager(), {}
    probe.PROBE.step_begins()
    serve(kv, live, "req-a", list(range(2 * BLOCK)))
    idle(kv, live)  # NOTE: a passing census: only the run's status can keep `check` from clean
    engine = SimpleNamespace(
        structured_output_manager=SimpleNamespace(clear_backend=lambda: None), model_executor=None, scheduler=None
    )
    raised = None
    try:
        try:
            if crash:
                kv.block_pool.get_new_blocks(NUM_BLOCKS + 1)
            raise SystemExit
        finally:
            EngineCore.shutdown(engine)
    except BaseException as err:  # NOTE: the driver reports it and exits normally (the run is closed)
        raised = f"{type(err).__name__}: {err}"
    return {"raised": raised, "active": probe.PROBE.state.active}


def reused_parent() -> dict:
    """A double free puts a live chain's first block Y at the free queue's tail, hash and all; a filler
    request drains the queue but one block before it, and the same request grows by two blocks: vLLM
    hands it that block, then Y (evicting Y's hash), and caches Y again after them, below its own
    child X. Between the idle census's snapshot and the next, X's recorded parent is Y and Y sits below X."""
    kv, live = manager(), {}
    probe.PROBE.step_begins()
    req = serve(kv, live, "req-a", list(range(2 * BLOCK + 1)))
    idle(kv, live)  # NOTE: the snapshot holds Y and X
    probe.PROBE.step_begins()
    table = kv.coordinator.single_type_managers[0].req_to_blocks["req-a"]
    first, second = table[0].block_id, table[1].block_id
    with probe_context("req-a"):
        kv.block_pool.free_blocks([table[0]])
    serve(kv, live, "filler", [5000 + i for i in range((kv.block_pool.get_num_free_blocks() - 2) * BLOCK)])
    for t in range(3 * BLOCK - 1):  # NOTE: five full blocks: the two new ones are full, so both are cached
        req.append_output_token_ids(7000 + t)
    kv.allocate_slots(req, len(req.all_token_ids) - req.num_computed_tokens)
    req.num_computed_tokens = len(req.all_token_ids)
    kv.cache_blocks(req, req.num_computed_tokens)
    probe.PROBE.state.recorder.close()
    return {"blocks": [b.block_id for b in table], "first": first, "second": second, "step": probe.PROBE.step}


def polled_then_crash() -> dict:
    """A live request's block is released once more (a double free); GET /kvscope/census polls the
    engine (EngineCore.kvscope_census, the utility the probe adds) twice at step 1 and once at step 2
    with the same finding, then at step 3 after a second block is released too often; then vLLM's own
    error ends the engine (no idle census ever ran)."""
    kv, live = manager(), {}
    probe.PROBE.step_begins()
    serve(kv, live, "req-hold", list(range(3 * BLOCK)))
    table = kv.coordinator.single_type_managers[0].req_to_blocks["req-hold"]
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(kv_cache_manager=kv, deferred_frees=[], requests=live, shutdown=lambda: None),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=0)),
        structured_output_manager=SimpleNamespace(clear_backend=lambda: None),
        model_executor=None,
    )
    with probe_context("req-hold"):
        kv.block_pool.free_blocks([table[0]])
    answers = [EngineCore.kvscope_census(engine), EngineCore.kvscope_census(engine)]
    probe.PROBE.step_begins()
    answers.append(EngineCore.kvscope_census(engine))
    probe.PROBE.step_begins()
    with probe_context("req-hold"):
        kv.block_pool.free_blocks([table[1]])
    answers.append(EngineCore.kvscope_census(engine))
    try:
        try:
            kv.block_pool.get_new_blocks(NUM_BLOCKS + 1)
        finally:
            EngineCore.shutdown(engine)
    except ValueError:
        pass
    return {"lostref": [a["lostref"] for a in answers], "blocks": [table[0].block_id, table[1].block_id]}


CHURN_ROUNDS = 240
CHURN_CENSUS_EVERY = 40
CHURN_ROUND_S = 0.005


def churn() -> dict:
    """Many short requests of distinct tokens (each caches blocks and evicts older ones), a hand-off
    per round (a chunk each) and an idle census every CHURN_CENSUS_EVERY rounds; in round 3 vLLM keeps
    one extra reference of a finished request's block (a leak every later census names). Enough events
    that a small KVSCOPE_MAX_SIZE or KVSCOPE_KEEP_EVENTS drops the oldest ones."""
    kv, live, censuses, injected = manager(), {}, [], []
    for i in range(CHURN_ROUNDS):
        probe.PROBE.step_begins()
        for j in range(2):
            rid = f"req-{i}-{j}"
            req = serve(kv, live, rid, [10_000 + 1000 * (2 * i + j) + t for t in range(3 * BLOCK + 1)])
            held = list(kv.coordinator.single_type_managers[0].req_to_blocks[rid])
            finish(kv, live, req)
            if i == 3 and j == 0:
                with probe_context(rid):
                    kv.block_pool.touch([held[0]])
                injected.append({"kind": "extra-ref", "block": held[0].block_id, "rid": rid})
        step_ends(kv, live)
        probe.PROBE.state.recorder.flush()  # NOTE: opened at the first step
        time.sleep(CHURN_ROUND_S)  # NOTE: the run lasts past a 0.5 s window however fast the machine
        if (i + 1) % CHURN_CENSUS_EVERY == 0:
            censuses.append(idle(kv, live))
    probe.PROBE.state.recorder.close()
    return {"censuses": censuses, "injected": injected}


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
