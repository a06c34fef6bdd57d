"""The cache families' shape: siblings behind BasePrefixCache (none inherits another family's
methods), each node class with only its own family's fields, and the `root` every cache
answers (None without a tree)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import kvscope.cache as cache_package
from kvscope.cache import (
    BasePrefixCache,
    ChunkCache,
    HiRadixCache,
    HiTreeNode,
    RadixCache,
    ScopedNode,
    ScopedRadixCache,
    SWANode,
    SWAPrefixCache,
    SWARadixCache,
    TreeNode,
)
from kvscope.cache.tree import NodeBase
from kvscope.mem import ReqToTokenPool, SWATokenToKVPoolAllocator, make_token_allocator
from tests.cache.helpers import Req, alloc_extend, ids
from tests.cache.hiradix.helpers import make_tiers

FAMILIES = (RadixCache, SWARadixCache, ScopedRadixCache, HiRadixCache)
CONTRACT = {BasePrefixCache, SWAPrefixCache}
# NOTE: the fields each family's node adds to NodeBase's (identity, key, locks, policy fields)
OWN_FIELDS = {
    TreeNode: {"children", "value"},
    SWANode: {"children", "value", "swa_lock_id", "swa_lock_ref", "tombstone"},
    ScopedNode: {"children", "value", "visibility", "tombstone", "holders", "hits", "path_hash"},
    HiTreeNode: {"children", "value", "host_value", "host_ref_counter", "write_op", "load_op"},
}
BASE_FIELDS = {"id", "parent", "key", "lock_ref", "last_access_time", "creation_time", "hit_count", "priority", "owner"}


def slots_of(node_class: type) -> set[str]:
    return {name for klass in node_class.__mro__ for name in getattr(klass, "__slots__", ())}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
def test_a_family_inherits_only_from_the_contract(family: type) -> None:
    ancestors = set(family.__mro__[1:]) - CONTRACT - {object} - set(BasePrefixCache.__mro__)
    assert not ancestors, f"{family.__name__} inherits from {sorted(a.__name__ for a in ancestors)}"
    for name, _ in inspect.getmembers(family, callable):
        owner = next(k for k in family.__mro__ if name in vars(k))
        assert owner is family or owner in CONTRACT or owner is object or owner in BasePrefixCache.__mro__, (
            f"{family.__name__}.{name} comes from {owner.__name__}"
        )


@pytest.mark.parametrize("node_class", list(OWN_FIELDS), ids=lambda c: c.__name__)
def test_a_node_class_carries_only_its_familys_fields(node_class: type[NodeBase]) -> None:
    assert slots_of(node_class) == BASE_FIELDS | OWN_FIELDS[node_class]


def test_the_package_exports_every_family() -> None:
    for family in (*FAMILIES, ChunkCache):
        assert getattr(cache_package, family.__name__) is family and family.__name__ in cache_package.__all__


def radix() -> tuple[BasePrefixCache, Any]:
    allocator = make_token_allocator(64, 1, "cpu", strict=True)
    return RadixCache(allocator, 1, strict=True), allocator


def swa_radix() -> tuple[BasePrefixCache, Any]:
    allocator = SWATokenToKVPoolAllocator(64, 64, 1, "cpu", strict=True)
    return SWARadixCache(allocator, 1, window_len=4, strict=True), allocator


def scoped() -> tuple[BasePrefixCache, Any]:
    allocator = make_token_allocator(64, 1, "cpu", strict=True)
    return ScopedRadixCache(allocator, 1, strict=True), allocator


def hiradix() -> tuple[BasePrefixCache, Any]:
    tiers = make_tiers()
    return tiers.cache, tiers.allocator


@pytest.mark.parametrize("make", [radix, swa_radix, scoped, hiradix], ids=lambda m: m.__name__)
def test_root_is_where_an_empty_match_ends_and_a_reset_replaces_it(
    make: Callable[[], tuple[BasePrefixCache, Any]],
) -> None:
    cache, allocator = make()
    root = cache.root
    assert root is not None and root.parent is None
    assert cache.match_prefix(ids(1, 2, 3)).last_node is root
    slots = alloc_extend(allocator, 0, 3, -1)
    assert slots is not None
    cache.insert(ids(1, 2, 3), slots)
    assert cache.match_prefix(ids(1, 2, 3)).last_node is not root
    cache.check_integrity()
    cache.reset()
    assert cache.root is not root and cache.root.parent is None


def test_a_cache_without_a_tree_has_no_root() -> None:
    allocator = make_token_allocator(32, 1, strict=True)
    cache = ChunkCache(allocator, 1, req_to_token_pool=ReqToTokenPool(2, 32))
    assert cache.root is None
    req = Req("r", ids(1, 2), req_pool_idx=0)
    assert cache.match_prefix(req.fill_ids).last_node is None
    assert torch.equal(
        cache.match_prefix(np.array([5], dtype=np.int32)).device_indices, torch.empty(0, dtype=torch.int64)
    )
