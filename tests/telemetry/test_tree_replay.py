"""Tree state at any step is reconstructable: a snapshot plus the structural events since
rebuild exactly the live tree's node table (ids, parents, sizes, locks, tombstones, owners)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from kvscope.cache import EvictParams, RadixCache, SWARadixCache
from kvscope.mem import SWATokenToKVPoolAllocator, make_token_allocator
from kvscope.telemetry import EventKind, ListRecorder
from kvscope.telemetry.tree_replay import replay_tree
from tests.cache.helpers import alloc_extend

STRUCTURE = ["node_id", "parent_id", "num_tokens", "lock_ref", "tombstone", "depth_tokens", "owner"]
USERS = ("alice", "bob", None)


def as_event_frame(recorder: ListRecorder, start: int) -> pd.DataFrame:
    rows = [(e.kind.value, e.node_id, e.num_tokens, e.aux, 0.0, e.principal) for e in recorder.events[start:]]
    return pd.DataFrame(rows, columns=["kind", "node_id", "num_tokens", "aux", "t_mono", "principal"])


def structure(frame: pd.DataFrame) -> pd.DataFrame:
    """The compared columns, sorted by node; a missing owner is None whatever the frame's dtype."""
    out = frame[STRUCTURE].astype({"parent_id": "Int64", "owner": object})
    out["owner"] = out["owner"].where(out["owner"].notna(), None)
    return out.sort_values("node_id").reset_index(drop=True)


def table(cache: Any) -> pd.DataFrame:
    return structure(pd.DataFrame(cache.export_nodes(), columns=cache.export_nodes()[0]._fields))


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
            user = USERS[int(seq[0])]  # NOTE: from the sequence, so the random stream stays as it was
            if swa:
                cache.insert(seq, slots, user=user, prev_prefix_len=match.prefix_len)
                allocator.free(slots[len(seq) // ps * ps :])
            else:
                prefix_len = cache.insert(seq, slots, user=user)
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
                cache.evict(EvictParams(0, int(cache.swa_evictable_size() * rng.random() * 0.3)))
            elif swa:
                cache.evict(EvictParams(full, int(cache.swa_evictable_size() * rng.random())))
            else:
                cache.evict(EvictParams(full))


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
        cache = RadixCache(
            allocator, ps, recorder=recorder, eviction_granularity="page" if kind == "radix-page" else "leaf"
        )
    snapshot = pd.DataFrame(cache.export_nodes(), columns=cache.export_nodes()[0]._fields)
    checkpoints_with_tombstones = 0
    locks: list[Any] = []
    for _ in range(400 if kind == "swa-radix" else 200):
        seen = len(recorder.events)
        drive(cache, allocator, rng, 1, kind == "swa-radix", locks)
        snapshot = replay_tree(snapshot, as_event_frame(recorder, seen))  # the previous state is the snapshot
        rebuilt = structure(snapshot)
        pd.testing.assert_frame_equal(rebuilt, table(cache), check_dtype=False)
        checkpoints_with_tombstones += bool(table(cache).tombstone.any())
    kinds = {e.kind for e in recorder.events}
    assert {EventKind.INSERT, EventKind.SPLIT, EventKind.EVICT, EventKind.LOCK, EventKind.UNLOCK} <= kinds
    owners = {e.principal for e in recorder.events if e.kind is EventKind.INSERT}
    assert {"alice", "bob", None} <= owners, "the owners the replay must follow are missing"
    if kind == "swa-radix":
        assert checkpoints_with_tombstones, "no checkpoint held a tombstone; the test would prove little"


def _root_snapshot(*rows: tuple[int, int | None, int]) -> pd.DataFrame:
    """A snapshot frame: the root (0) and (node, parent, tokens) rows."""
    nodes = [(0, None, 0), *rows]
    frame = pd.DataFrame(
        [
            {"node_id": n, "parent_id": p, "num_tokens": t, "token_preview": "", "lock_ref": 0, "last_access_time": 0.0}
            | {"hit_count": 0, "owner": None, "tombstone": False, "depth_tokens": 0}
            for n, p, t in nodes
        ]
    )
    return frame.astype({"parent_id": "Int64"})


def _events(*rows: tuple[str, int, int, int]) -> pd.DataFrame:
    return pd.DataFrame(
        [(kind, node, tokens, aux, 0.0, None) for kind, node, tokens, aux in rows],
        columns=["kind", "node_id", "num_tokens", "aux", "t_mono", "principal"],
    )


def _links(table: pd.DataFrame) -> dict[int, int | None]:
    return {int(n): (None if pd.isna(p) else int(p)) for n, p in zip(table["node_id"], table["parent_id"], strict=True)}


def test_a_link_to_a_reused_id_inserted_below_its_child_is_an_orphans_not_a_cycle() -> None:
    """vLLM's ids are reused: block 7 is evicted while block 9, cached below it, stays (an orphan, as
    after a double free); the reused 7 is cached after 9. The replay followed 9's stale link to
    the new 7, whose parent is 9 (a RecursionError on the Radix tree page); now 9 is an orphan under
    the root and 7 sits below it."""
    events = _events(("insert", 7, 16, 0), ("insert", 9, 16, 7), ("evict", 7, 16, 0), ("insert", 7, 16, 9))
    table = replay_tree(_root_snapshot(), events)
    assert _links(table) == {0: None, 9: 0, 7: 9}
    assert dict(zip(table["node_id"], table["depth_tokens"], strict=True)) == {0: 0, 9: 16, 7: 32}
    # NOTE: no cycle, still stale: the reused 7 cached under another chain is not 9's parent
    elsewhere = _events(("insert", 7, 16, 0), ("insert", 9, 16, 7), ("evict", 7, 16, 0), ("insert", 7, 16, 3))
    assert _links(replay_tree(_root_snapshot((3, 0, 16)), elsewhere)) == {0: None, 3: 0, 9: 0, 7: 3}


def test_a_snapshot_that_holds_a_cycle_shows_every_node() -> None:
    """A snapshot written with a cycle (5 -> 6 -> 5, and 8 below it): every node is shown, the link
    that closes the cycle cut to the root, depths finite."""
    table = replay_tree(_root_snapshot((5, 6, 16), (6, 5, 16), (8, 6, 16), (3, 0, 16)), _events())
    links = _links(table)
    assert sorted(links) == [0, 3, 5, 6, 8]
    for node in links:  # NOTE: every node reaches the root
        seen, up = set(), node
        while links[up] is not None:
            assert up not in seen
            seen.add(up)
            up = links[up]
        assert up == 0
    assert sorted(table["depth_tokens"]) == [0, 16, 16, 32, 32]
