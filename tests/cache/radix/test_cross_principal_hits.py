"""Global-sharing caches report cross-principal reuse: a match event names its requester, and a
cross_hit event counts the matched tokens that sit in nodes another principal owns (radix and
SWA radix). Each negative (no cross_hit) is paired with the positive it differs from by one thing."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.cache import RadixCache, SWARadixCache
from kvscope.mem import SWATokenToKVPoolAllocator, make_token_allocator
from kvscope.telemetry import NULL_RECORDER, EventKind, ListRecorder
from tests.cache.helpers import alloc_extend

SHARED = np.arange(1, 9, dtype=np.int32)  # 8 tokens alice inserts
KINDS = ("radix", "swa-radix")


def make(kind: str, recorder: ListRecorder | None = None) -> RadixCache | SWARadixCache:
    chosen = NULL_RECORDER if recorder is None else recorder
    if kind == "radix":
        return RadixCache(make_token_allocator(128, 1, "cpu"), 1, recorder=chosen, strict=True)
    allocator = SWATokenToKVPoolAllocator(128, 128, 1, "cpu", strict=True)
    return SWARadixCache(allocator, 1, window_len=4, recorder=chosen, strict=True)


def insert_as(cache: RadixCache | SWARadixCache, tokens: np.ndarray, user: str | None) -> None:
    """Insert `tokens` with fresh slots as `user`; the slots of a prefix already cached are freed
    (by the caller for radix, by the insert itself for SWA radix)."""
    fresh = alloc_extend(cache.allocator, 0, len(tokens), -1)
    assert fresh is not None
    if isinstance(cache, RadixCache):
        cached_len = cache.insert(tokens, fresh, user=user)
        cache.allocator.free(fresh[:cached_len])
    else:
        cache.insert(tokens, fresh, user=user)


def cross_hits(recorder: ListRecorder, rid: str) -> list[int]:
    return [e.num_tokens for e in recorder.of_kind(EventKind.CROSS_HIT) if e.rid == rid]


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_principal_reusing_the_prefix_is_a_cross_hit_and_a_repeat_is_not(kind: str) -> None:
    recorder = ListRecorder()
    cache = make(kind, recorder)
    insert_as(cache, SHARED, "t1-alice")
    query = np.concatenate((SHARED, [40, 41])).astype(np.int32)
    cache.match_prefix(query, user="t2-bob", rid="bob")  # positive: bob reuses alice's 8 tokens
    cache.match_prefix(query, user="t1-alice", rid="alice")  # control: alice reuses her own
    cache.check_integrity()
    assert cross_hits(recorder, "bob") == [8]
    assert cross_hits(recorder, "alice") == []
    matches = {e.rid: e for e in recorder.of_kind(EventKind.MATCH) if e.rid in ("bob", "alice")}
    assert (matches["bob"].principal, matches["bob"].num_tokens) == ("t2-bob", 8)
    assert (matches["alice"].principal, matches["alice"].num_tokens) == ("t1-alice", 8)
    assert recorder.of_kind(EventKind.CROSS_HIT)[0].node_id == matches["bob"].node_id


@pytest.mark.parametrize("kind", KINDS)
def test_only_the_tokens_in_other_principals_nodes_count(kind: str) -> None:
    """bob extends alice's prefix with 4 tokens of his own: carol reusing all 12 crosses 12,
    bob reusing all 12 crosses only alice's 8."""
    recorder = ListRecorder()
    cache = make(kind, recorder)
    insert_as(cache, SHARED, "alice")
    longer = np.concatenate((SHARED, [20, 21, 22, 23])).astype(np.int32)
    insert_as(cache, longer, "bob")
    cache.match_prefix(longer, user="bob", rid="bob-again")
    cache.match_prefix(longer, user="carol", rid="carol")
    cache.check_integrity()
    assert cross_hits(recorder, "bob-again") == [8]
    assert cross_hits(recorder, "carol") == [12]


@pytest.mark.parametrize("kind", KINDS)
def test_nodes_with_no_owner_are_nobodys(kind: str) -> None:
    """A prefix inserted with no principal is reused by anyone without a cross hit; the same
    prefix inserted by a principal is a cross hit for another (the positive)."""
    recorder = ListRecorder()
    cache = make(kind, recorder)
    insert_as(cache, SHARED, None)
    owned = np.arange(50, 58, dtype=np.int32)
    insert_as(cache, owned, "alice")
    cache.match_prefix(SHARED, user="bob", rid="unowned")
    cache.match_prefix(owned, user="bob", rid="owned")
    cache.check_integrity()
    assert cross_hits(recorder, "unowned") == []
    assert cross_hits(recorder, "owned") == [8]


def test_a_recorder_does_not_change_the_match() -> None:
    recorder = ListRecorder()
    recorded, quiet = make("radix", recorder), make("radix")
    for cache in (recorded, quiet):
        insert_as(cache, SHARED, "alice")
    got = [cache.match_prefix(SHARED, user="bob").device_indices.tolist() for cache in (recorded, quiet)]
    assert got[0] == got[1] and len(got[0]) == len(SHARED)
    assert len(recorder.of_kind(EventKind.CROSS_HIT)) == 1
    for cache in (recorded, quiet):
        cache.check_integrity()


def test_exported_nodes_are_public_and_keep_their_owner() -> None:
    cache = make("radix")
    insert_as(cache, SHARED, "t1-alice")
    rows = cache.export_nodes()
    assert {r.visibility for r in rows} == {"public"}
    assert {r.owner for r in rows if r.parent_id is not None} == {"t1-alice"}
    cache.check_integrity()
