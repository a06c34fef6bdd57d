"""What the vLLM probe reads of vLLM's block pool at a census or a snapshot (vLLM 0.32): the pool as a
BlockView for the census (census.py), and its cached blocks as NodeRows (vLLM's hash chains as a tree,
with the requests whose block tables hold each block). Reads only, between engine steps; nothing here
is on a hot path. Imports: stdlib, numpy, the probe's census and kvscope.telemetry."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.probe.census import BlockView
from kvscope.telemetry import NodeRow
from kvscope.telemetry.page_hash import PAGE_HASH_BYTES

ROOT = NodeRow(0, None, 0, "", 0, 0.0, 0, None, False, 0, page_hashes=b"")


def tree_rows(manager: Any, parents: dict[int, tuple[int, Any]], block_size: int) -> list[NodeRow]:
    """vLLM's prefix cache as a tree snapshot, in the rows kvscope's own caches write: the root (0),
    then every cached (hashed) block, parents first. node = the block id, parent = the block before it
    in its hash chain (the root for a chain's first block, and for an orphan whose parent was evicted
    or re-cached since), num_tokens = the block size, lock_ref = its ref count, owner = the requests
    whose block tables hold it (joined by ",", cut to 64 characters), depth_tokens = its position's
    end in the chain. vLLM keeps no tokens, access times or hit counts per block: "", 0.0 and 0."""
    pool = manager.block_pool
    blocks = pool.blocks
    holders: dict[int, list[str]] = {}
    for single in manager.coordinator.single_type_managers:
        for rid, table in single.req_to_blocks.items():
            for block in table:
                if not block.is_null:
                    holders.setdefault(block.block_id, []).append(rid)
    cached = {b.block_id: b for b in blocks if b.block_hash is not None and not b.is_null}
    parent_of: dict[int, int] = {}
    for block_id in cached:
        entry = parents.get(block_id)
        alive = entry is not None and entry[0] in cached and blocks[entry[0]].block_hash is entry[1]
        parent_of[block_id] = entry[0] if alive and entry is not None else 0
    depth: dict[int, int] = {0: 0}

    def depth_of(block_id: int) -> int:
        """Chained hashes make the links acyclic: a block's chain holds only blocks cached before it."""
        chain = []
        while block_id not in depth:
            chain.append(block_id)
            block_id = parent_of[block_id]
            if len(chain) > len(parent_of):  # NOTE: never loop on the engine's thread (guarded: recording stops)
                raise RuntimeError("the cached blocks' parent links form a cycle")
        for node in reversed(chain):
            depth[node] = depth[parent_of[node]] + 1
        return depth[chain[0]] if chain else depth[block_id]

    rows = [ROOT]
    for block_id in sorted(cached, key=depth_of):
        block = cached[block_id]
        owner = ",".join(sorted(set(holders.get(block_id, ()))))[:64] or None
        rows.append(
            NodeRow(
                block_id,
                parent_of[block_id],
                block_size,
                "",
                int(block.ref_cnt),
                0.0,
                0,
                owner,
                False,
                depth[block_id] * block_size,
                page_hashes=bytes(block.block_hash)[:PAGE_HASH_BYTES],  # NOTE: vLLM's chained hash (+ group id)
            )
        )
    return rows


def block_view(pool: Any) -> BlockView:
    """The pool for the census: ref counts as an array by block id (vLLM's block ids are their
    indexes in pool.blocks, the null block's is 0), the free queue walked once, the hashed blocks
    among it."""
    blocks = pool.blocks
    free = pool.free_block_queue
    queued_blocks = free_list(free, len(blocks))
    return BlockView(
        ref_counts=np.fromiter([b.ref_cnt for b in blocks], dtype=np.int64, count=len(blocks)),
        hashed={b.block_id for b in queued_blocks if b.block_hash is not None},
        queued=[b.block_id for b in queued_blocks],
        queue_counter=free.num_free_blocks,
    )


def free_list(queue: Any, num_blocks: int) -> list[Any]:
    """The free queue's blocks, head first (FreeKVCacheBlockQueue's links). NOTE: never loop on the
    engine's thread: links corrupted into a cycle (a block appended twice) stop the walk after one
    more block than the pool has, and the census sees a queue longer than its counter."""
    found: list[Any] = []
    tail = queue.fake_free_list_tail
    node = queue.fake_free_list_head.next_free_block
    while node is not None and node is not tail and len(found) <= num_blocks:
        found.append(node)
        node = node.next_free_block
    return found
