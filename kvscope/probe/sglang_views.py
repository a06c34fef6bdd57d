"""What the SGLang probe reads of SGLang's objects, at a census or a snapshot (SGLang 0.5.23): each pool
as a PageView for the page census (full, swa through SGLang's full -> SWA mapping, the request rows,
mamba), the live requests' pages, and the tree as NodeRows (a node per tree node for the Python tree
core, a node per page for the Rust core). Reads only; nothing here is on a hot path. Imports: stdlib,
numpy, the probe's census and kvscope.telemetry (torch is the engine's, found in sys.modules)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

from kvscope.probe.sglang_census import PageView
from kvscope.telemetry import NodeRow

PREVIEW_TOKENS = 8


class Holder(NamedTuple):
    """What a census reads of one holder of a row: a live request, or a streaming session's KV record
    between its turns (named `session <id>`: the session, not a request, then holds its row, its pages
    past the tree's prefix and its Mamba slots; SGLang's identity counts them as session_held). `kv`:
    its KV record (`req_pool_idx`, `cache_protected_len`, `kv_allocated_len`; the family's reader of a
    request makes it: the request's own ReqKvInfo from 0.5.19, a KvSpan on 0.5.18)."""

    rid: str
    kv: Any


class KvSpan(NamedTuple):
    """SGLang 0.5.18's KV record of a request (or a session's slot), read where 0.5.18 keeps it: the row
    and the tree's protected length on the request itself, the allocated length on its ReqKvInfo (None
    once released, or before its first allocation: nothing allocated)."""

    req_pool_idx: int | None
    cache_protected_len: int
    kv_allocated_len: int


def kv_span_0518(holder: Any) -> KvSpan:
    """A 0.5.18 request's (or SessionSlot's) KV record as the census and the binds read it."""
    kv = holder.kv
    return KvSpan(holder.req_pool_idx, holder.cache_protected_len, 0 if kv is None else kv.kv_allocated_len)


def session_holders(tree: Any) -> tuple[list[Holder], list[Any]]:
    """UnifiedRadixCache's streaming sessions (StreamingSession.slots in 0.5.23; none in other trees):
    each session's record that holds a row, and the node of each prefix lock a session holds (taken
    by its first turn's request, kept by the session after that request finished)."""
    slots = getattr(getattr(tree, "session", None), "slots", None)
    if not slots:
        return [], []
    records = [Holder(f"session {sid}", slot.kv) for sid, slot in slots.items() if slot.kv.holds_kv]
    return records, [slot.lock.node for slot in slots.values() if slot.lock is not None]


def session_holders_0518(tree: Any) -> tuple[list[Holder], list[Any]]:
    """session_holders for SGLang 0.5.18, whose SessionSlot keeps its row, protected length and lock node
    (`last_node`, locked by its first turn until the close) itself, and a ReqKvInfo only while it holds KV
    (`is_holding_kv`)."""
    slots = getattr(getattr(tree, "session", None), "slots", None)
    if not slots:
        return [], []
    held = [(sid, slot) for sid, slot in slots.items() if slot.is_holding_kv]
    records = [Holder(f"session {sid}", kv_span_0518(slot)) for sid, slot in held]
    return records, [slot.last_node for slot in slots.values() if slot.last_node is not None]


def row_view(rows: Any, owners: list[Any]) -> PageView:
    owned = [(int(req.kv.req_pool_idx), req.rid) for req in owners if req.kv.req_pool_idx is not None]
    return PageView(1, int(rows.size), [int(r) for r in rows.free_slots], set(), dict(owned), tuple(owned))


def page_view(allocator: Any, in_tree: list[int], rows: Any, owners: list[Any]) -> PageView:
    ps = int(allocator.page_size)
    tree_pages = {s // ps for s in in_tree}
    owned = [(page, rid) for rid, part in _owned_rows(rows, owners) for page in {s // ps for s in part.tolist()}]
    return PageView(
        ps,
        _num_pages(allocator),
        _free_list(allocator),
        tree_pages,
        live_pages(rows, owners, ps),
        tuple(owned),
        twice(in_tree, ps),
    )


def twice(slots: list[int], page_size: int) -> frozenset[int]:
    """The pages of the slots listed more than once (a tree's values: a slot two nodes hold)."""
    return frozenset(s // page_size for s, n in Counter(slots).items() if n > 1)


def _num_pages(allocator: Any) -> int:
    return int(getattr(allocator, "num_pages", 0) or allocator.size // allocator.page_size)


def _free_list(allocator: Any) -> list[int]:
    """The allocator's free pages: SGLang's get_all_free_pages (0.5.20 on); before, its free_pages and the
    release_pages its frees may stage (merged into free_pages by merge_and_sort_free)."""
    getter = getattr(allocator, "get_all_free_pages", None)
    if getter is None:
        return [
            p for part in (allocator.free_pages, allocator.release_pages) if part is not None for p in part.tolist()
        ]
    free = getter()
    return [] if free is None else free.tolist()


def tree_slots(tree: Any) -> list[int]:
    """The full pool's token slots the tree holds (every tree core)."""
    if tree.evictable_size() + tree.protected_size() == 0:
        return []
    return tree.all_values_flatten().tolist()


def stale_locked_pages(tree: Any, holders: list[Any], live: dict[int, str], page_size: int) -> set[int]:
    """The full pool's pages under a lock no live holder accounts for, from the tree's own lock counts
    (level summary keeps no lock ledger). `holders`: the node each live lock was taken on (a running
    request's TreeLock.node, a streaming session's); a lock counts on its node and every ancestor.
    RadixCache and the Python tree core: the device pages of each node whose (full component's)
    lock_ref is above its live holders' count. The Rust core keeps its counts in Rust: the pages its
    walk of unlocked slots leaves out that no live row holds (a running request's row holds the prefix
    it locked), which cannot see a lock stacked on a node a live request also holds."""
    if tree.protected_size() == 0:
        return set()
    core = getattr(tree, "tree_core", None)
    if core is None:
        return _excess_lock_pages(tree.root_node, None, [h for h in holders if h is not None], page_size)
    try:
        root = core.root_node
    except NotImplementedError:  # NOTE: the Rust core: no node handles outside Rust
        every = core.walk_for_kv_canary(False, False).slot_indices.tolist()
        unlocked = core.walk_for_kv_canary(True, False).slot_indices.tolist()
        return {s // page_size for s in every} - {s // page_size for s in unlocked} - set(live)
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    nodes = [core.node_by_id(h) if isinstance(h, int) else h for h in holders if h is not None]
    return _excess_lock_pages(root, int(ComponentType.FULL), nodes, page_size)


def _excess_lock_pages(root: Any, full: int | None, holders: list[Any], page_size: int) -> set[int]:
    held: dict[int, int] = {}
    for node in holders:
        while node is not None and node is not root:
            held[id(node)] = held.get(id(node), 0) + 1
            node = node.parent
    pages: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        data = node if full is None else node.component_data[full]
        if node is not root and int(data.lock_ref) > held.get(id(node), 0):
            pages |= _pages_of(data.value, page_size)
        stack.extend(node.children.values())
    return pages


def swa_pool(allocator: Any) -> Any:
    """The SWA sub-allocator of SGLang's SWATokenToKVPoolAllocator, None where there is no separate
    paged SWA pool: no SWA allocator, the all-SWA variant (one pool: the full census covers it), or
    the per-request SWA ring (its SWA memory is a row's, counted by the req census)."""
    swa = getattr(allocator, "swa_attn_allocator", None)
    if (
        swa is None
        or swa is getattr(allocator, "full_attn_allocator", None)
        or getattr(allocator, "swa_req_ring", False)
    ):
        return None
    return swa


def swa_view(allocator: Any, swa: Any, in_tree: list[int], rows: Any, owners: list[Any]) -> PageView:
    """The SWA pool through SGLang's full -> SWA slot mapping (0: no SWA peer; free_swa clears an
    entry when it frees the peer): the tree's SWA pages are the peers of its full slots, a live
    request's the peers of its row's slots."""
    ps = int(swa.page_size)
    mapping = allocator.full_to_swa_index_mapping
    peers = mapping[_index(in_tree, mapping)].tolist() if in_tree else []
    tree_pages = {p // ps for p in peers if p > 0}
    live: dict[int, str] = {}
    for rid, row in _live_rows(rows, owners):
        for peer in mapping[row.to(mapping.dtype)].tolist():
            if peer > 0:
                live.setdefault(peer // ps, rid)
    owned = [
        (page, rid)
        for rid, part in _owned_rows(rows, owners)
        for page in {p // ps for p in mapping[part.to(mapping.dtype)].tolist() if p > 0}
    ]
    tree_twice = twice([p for p in peers if p > 0], ps)
    return PageView(ps, _num_pages(swa), _free_list(swa), tree_pages, live, tuple(owned), tree_twice)


def mamba_allocator(rows: Any) -> Any:
    """The Mamba slot allocator of SGLang's HybridReqToTokenPool, None where there is none or where it
    is not a MambaSlotAllocator (the unified memory pool's UnifiedMambaSlotAllocator hands out virtual
    ids and lists no free slots: not censused)."""
    allocator = getattr(rows, "mamba_allocator", None)
    if allocator is None:
        return None
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator

    return allocator if isinstance(allocator, MambaSlotAllocator) else None


def mamba_view(tree: Any, rows: Any, allocator: Any, owners: list[Any]) -> PageView:
    """The Mamba pool's slots (a "page" of size 1; slot 0 is SGLang's dummy): free = the allocator's
    free list, in the tree = the unified tree's Mamba values (none under an int8 checkpoint pool, where
    the tree's states live in that pool's own slots), a live request's = its row's mamba index and its
    ping-pong track slots (SGLang's extra buffer; -1 where empty)."""
    in_tree = getattr(tree, "supports_mamba", lambda: False)() and getattr(rows, "mamba_ckpt_pool", None) is None
    tree_slots = tree.all_mamba_values_flatten().tolist() if in_tree else []
    held = [req for req in owners if req.kv.req_pool_idx is not None]
    live: dict[int, str] = {}
    owned: list[tuple[int, str]] = []  # NOTE: a row's Mamba slots are its own (a hit copies the tree's state)
    if held:
        mapping = rows.req_index_to_mamba_index_mapping
        index = mapping.new_tensor([int(req.kv.req_pool_idx) for req in held]).long()
        columns = [mapping[index].long().unsqueeze(1)]
        if getattr(rows, "enable_mamba_extra_buffer", False):
            columns.append(rows.req_index_to_mamba_ping_pong_track_buffer_mapping[index].long())
        table = sys.modules["torch"].cat(columns, 1).tolist()
        for req, slots in zip(held, table, strict=True):
            for slot in {s for s in slots if s > 0}:
                live.setdefault(slot, req.rid)
                owned.append((slot, req.rid))
    free = allocator.free_slots.tolist()
    return PageView(1, int(allocator.size), free, set(tree_slots), live, tuple(owned), twice(tree_slots, 1))


def _index(slots: list[int], like: Any) -> Any:
    """A list of slots as an index tensor on `like`'s device (SGLang's tensors; no torch import here)."""
    return like.new_tensor(slots)


def live_pages(rows: Any, owners: Any, page_size: int) -> dict[int, str]:
    """The pages in the live requests' rows -> the first request holding each."""
    live: dict[int, str] = {}
    for rid, row in _live_rows(rows, owners):
        for slot in row.tolist():
            live.setdefault(int(slot) // page_size, rid)
    return live


def _owned_rows(rows: Any, owners: Any) -> Iterator[tuple[str, Any]]:
    """(rid, its row's own part: past the tree prefix it locked, [cache_protected_len, kv_allocated_len),
    what SGLang counts as the request's private tokens) of each live request holding a row."""
    table = rows.req_to_token
    for req in owners:
        kv = req.kv
        if kv.req_pool_idx is not None:
            yield req.rid, table[kv.req_pool_idx, int(kv.cache_protected_len) : int(kv.kv_allocated_len)]


def _live_rows(rows: Any, owners: Any) -> Iterator[tuple[str, Any]]:
    """(rid, the allocated part of its row in req_to_token) of each live request holding a row."""
    table = rows.req_to_token
    for req in owners:
        kv = req.kv
        if kv.req_pool_idx is not None:
            yield req.rid, table[kv.req_pool_idx, : int(kv.kv_allocated_len)]


def tree_rows(tree: Any, live: dict[int, str], page_size: int) -> list[NodeRow]:
    """SGLang's radix tree as a tree snapshot, in the rows kvscope's own caches write (NodeRow): the
    root, then every node, parents first. node = SGLang's node id, num_tokens = its key's length,
    token_preview = its first token ids, lock_ref = its (full component's) lock count, owner = the live
    requests whose rows hold its device pages (joined by ",", cut to 64 characters), tombstone = no
    device value (evicted; tier host when a host copy remains). RadixCache's and the Python tree
    core's nodes are walked; the Rust tree core exposes no nodes (page_rows)."""
    core = getattr(tree, "tree_core", None)
    if core is None:
        return _node_rows(tree.root_node, None, live, page_size)
    try:
        root = core.root_node
    except NotImplementedError:  # NOTE: the Rust core: no node handles outside Rust
        return page_rows(core, live, page_size)
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return _node_rows(root, int(ComponentType.FULL), live, page_size)


def _node_rows(root: Any, full: int | None, live: dict[int, str], page_size: int) -> list[NodeRow]:
    rows = []
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        node, start = stack.pop()
        data = node if full is None else node.component_data[full]
        value, key = data.value, node.key
        tokens = 0 if node is root or key is None else len(key)
        host = full is not None and getattr(data, "host_value", None) is not None
        evicted = node is not root and value is None
        owners = sorted({live[p] for p in _pages_of(value, page_size) if p in live}) if not evicted else []
        preview = (
            ""
            if node is root
            else " ".join(map(str, key.token_ids[:PREVIEW_TOKENS])) + (" …" if tokens > PREVIEW_TOKENS else "")
        )
        rows.append(
            NodeRow(
                int(node.id),
                None if node is root else int(node.parent.id),
                tokens,
                preview,
                int(data.lock_ref),
                float(node.last_access_time),
                int(node.hit_count),
                ",".join(owners)[:64] or None,
                evicted,
                start + tokens,
                "public",
                ("host" if evicted else "device+host") if host else "device",
            )
        )
        stack.extend((child, start + tokens) for child in reversed(list(node.children.values())))
    return rows


def _pages_of(value: Any, page_size: int) -> set[int]:
    if value is None or len(value) == 0:
        return set()
    return {int(s) // page_size for s in value.tolist()}


def page_rows(core: Any, live: dict[int, str], page_size: int) -> list[NodeRow]:
    """The Rust tree core keeps its nodes in Rust: the tree as pages, from its KV-canary walk (every
    device slot with its position and the slot before it): node = page id, parent = the page of the
    slot before its first slot (the root, id 0, at position 0), lock_ref 1 when the walk of unlocked
    slots leaves the page out. No tokens, access times or hit counts: "", 0.0 and 0.
    NOTE: a corrupt tree (a double free handed a page to a second node) lists a page twice: its row
    is its first place, the preview says where else it is (the census names it: twice); a parent is
    a page already written (else the root), so the rows are unique and acyclic by construction."""
    walk = core.walk_for_kv_canary(False, False)
    unlocked = core.walk_for_kv_canary(True, False)
    free_of_locks = {int(s) // page_size for s in unlocked.slot_indices.tolist()}
    rows = [NodeRow(0, None, 0, "", 0, 0.0, 0, None, False, 0)]
    firsts = sorted(
        (int(pos), int(slot) // page_size, int(prev))
        for slot, pos, prev in zip(
            walk.slot_indices.tolist(), walk.positions.tolist(), walk.prev_slot_indices.tolist(), strict=True
        )
        if int(pos) % page_size == 0
    )
    elsewhere: dict[int, list[int]] = {}
    kept: dict[int, tuple[int, int]] = {}
    for pos, page, prev in firsts:
        if page in kept:
            elsewhere.setdefault(page, []).append(pos)
        else:
            kept[page] = (pos, prev)
    written = {0}
    for page, (pos, prev) in kept.items():
        parent = prev // page_size if prev >= 0 else 0
        also = elsewhere.get(page)
        rows.append(
            NodeRow(
                page,
                parent if parent in written else 0,  # NOTE: or an orphan's, or a later page's
                page_size,
                "" if also is None else f"also at position {', '.join(map(str, also))} (a page held twice)",
                0 if page in free_of_locks else 1,
                0.0,
                0,
                live.get(page),
                False,
                pos + page_size,
            )
        )
        written.add(page)
    return rows
