"""Tree state at any step is reconstructable: a snapshot plus the structural events since
rebuild exactly the live tree's node table (ids, parents, sizes, locks, tombstones)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from kvscope.cache import RadixCache, SWARadixCache
from kvscope.mem import SWATokenToKVPoolAllocator, make_token_allocator
from kvscope.telemetry import ListRecorder
from kvscope.telemetry.tree_replay import replay_tree
from tests.cache.helpers import alloc_extend

STRUCTURE = ["node_id", "parent_id", "num_tokens", "lock_ref", "tombstone", "depth_tokens"]


def as_event_frame(recorder: ListRecorder, start: int) -> pd.DataFrame:
    rows = [(e.kind.value, e.node_id, e.num_tokens, e.aux, 0.0) for e in recorder.events[start:]]
    return pd.DataFrame(rows, columns=["kind", "node_id", "num_tokens", "aux", "t_mono"])


def table(cache: Any) -> pd.DataFrame:
    frame = pd.DataFrame(cache.export_nodes(), columns=cache.export_nodes()[0]._fields)
    return frame[STRUCTURE].astype({"parent_id": "Int64"}).sort_values("node_id").reset_index(drop=True)


def drive(cache: Any, allocator: Any, rng: np.random.Generator, steps: int, swa: bool, locks: list[Any]) -> None:
    ps = cache.page_size
    for _ in range(steps):
        op = rng.integers(5)
        if op <= 1:
            seq = rng.integers(0, 3, size=rng.integers(1, 30)).astype(np.int32)
            match = cache.match_prefix(seq)
            need = len(seq) - match.prefix_len
            avail = allocator.full_available_size() if swa else allocator.available_size()
            if need + ps > avail:
                continue
            last = int(match.device_indices[-1]) if match.prefix_len else -1
            new = alloc_extend(allocator, match.prefix_len, len(seq), last)
            if new is None:
                continue
            slots = torch.cat((match.device_indices, new))
            if swa:
                cache.insert(seq, slots, prev_prefix_len=match.prefix_len)
                allocator.free(slots[len(seq) // ps * ps :])
            else:
                prefix_len = cache.insert(seq, slots)
                allocator.free(slots[match.prefix_len : prefix_len])
                allocator.free(slots[len(seq) // ps * ps :])
        elif op == 2:
            match = cache.match_prefix(rng.integers(0, 3, size=rng.integers(1, 30)).astype(np.int32))
            locks.append((match.last_node, cache.inc_lock_ref(match.last_node)))
        elif op == 3 and locks:
            node, lock_id = locks.pop(rng.integers(len(locks)))
            cache.dec_lock_ref(node, lock_id)
        elif op == 4:
            full = int(cache.evictable_size() * rng.random())
            if swa and rng.random() < 0.7:
                cache.evict(0, int(cache.swa_evictable_size() * rng.random() * 0.3))
            elif swa:
                cache.evict(full, int(cache.swa_evictable_size() * rng.random()))
            else:
                cache.evict(full)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["radix", "radix-page", "swa-radix"])
def test_snapshot_plus_events_rebuilds_the_live_tree(kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    recorder = ListRecorder()
    ps = 2 if seed % 2 else 1
    if kind == "swa-radix":
        allocator: Any = SWATokenToKVPoolAllocator(400, 200, ps)
        cache: Any = SWARadixCache(allocator, ps, window_len=2, recorder=recorder)
    else:
        allocator = make_token_allocator(400, ps)
        cache = RadixCache(allocator, ps, recorder=recorder,
                           eviction_granularity="page" if kind == "radix-page" else "leaf")
    snapshot = pd.DataFrame(cache.export_nodes(), columns=cache.export_nodes()[0]._fields)
    checkpoints_with_tombstones = 0
    locks: list[Any] = []
    for _ in range(400 if kind == "swa-radix" else 200):
        seen = len(recorder.events)
        drive(cache, allocator, rng, 1, kind == "swa-radix", locks)
        snapshot = replay_tree(snapshot, as_event_frame(recorder, seen))  # the previous state is the snapshot
        rebuilt = snapshot[STRUCTURE].sort_values("node_id").reset_index(drop=True)
        pd.testing.assert_frame_equal(rebuilt, table(cache), check_dtype=False)
        checkpoints_with_tombstones += bool(table(cache).tombstone.any())
    kinds = {e.kind.value for e in recorder.events}
    assert {"insert", "split", "evict", "lock", "unlock"} <= kinds
    if kind == "swa-radix":
        assert checkpoints_with_tombstones, "no checkpoint held a tombstone; the test would prove little"
