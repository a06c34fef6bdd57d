"""The tree pieces the radix families share: nodes and their operations, eviction policies
and the leaf heap, LockedTree (locks, counts, evictable leaves, the eviction loop), the tree
invariants, and request caching."""

from kvscope.cache.tree.core import ROOT_PRIORITY, LockedTree, PageFiledTree, check_tree_options
from kvscope.cache.tree.eviction import POLICIES, EvictionPolicy, LeafHeap, get_policy
from kvscope.cache.tree.integrity import check_node_shape, check_sizes, check_tree_slots
from kvscope.cache.tree.node import (
    EMPTY_SLOTS,
    TOKEN_BYTES,
    NodeBase,
    SlotNode,
    TreeNode,
    claim_slots,
    common_page_len,
    detach_child,
    export_rows,
    node_values,
    page_hashes,
    preview,
    render,
    slots_tensor,
    split_node,
    up_path,
    walk,
)
from kvscope.cache.tree.requests import RequestTree, cache_finished_req, cache_unfinished_req

__all__ = [
    "EMPTY_SLOTS",
    "POLICIES",
    "ROOT_PRIORITY",
    "TOKEN_BYTES",
    "EvictionPolicy",
    "LeafHeap",
    "LockedTree",
    "NodeBase",
    "PageFiledTree",
    "RequestTree",
    "SlotNode",
    "TreeNode",
    "cache_finished_req",
    "cache_unfinished_req",
    "check_node_shape",
    "check_sizes",
    "check_tree_options",
    "check_tree_slots",
    "claim_slots",
    "common_page_len",
    "detach_child",
    "export_rows",
    "get_policy",
    "node_values",
    "page_hashes",
    "preview",
    "render",
    "slots_tensor",
    "split_node",
    "up_path",
    "walk",
]
