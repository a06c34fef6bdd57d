"""The tree pieces both radix families share: nodes and their operations, eviction
policies and the leaf heap, the tree invariants, and request caching."""

from kvscope.cache.tree.eviction import POLICIES, EvictionPolicy, LeafHeap, get_policy
from kvscope.cache.tree.integrity import check_node_shape, check_sizes, check_tree_slots
from kvscope.cache.tree.node import (
    EMPTY_SLOTS,
    TOKEN_BYTES,
    TreeNode,
    claim_slots,
    common_page_len,
    export_rows,
    node_values,
    preview,
    render,
    slots_tensor,
    split_node,
    walk,
)
from kvscope.cache.tree.requests import RequestTree, cache_finished_req, cache_unfinished_req

__all__ = [
    "EMPTY_SLOTS",
    "POLICIES",
    "TOKEN_BYTES",
    "EvictionPolicy",
    "LeafHeap",
    "RequestTree",
    "TreeNode",
    "cache_finished_req",
    "cache_unfinished_req",
    "check_node_shape",
    "check_sizes",
    "check_tree_slots",
    "claim_slots",
    "common_page_len",
    "export_rows",
    "get_policy",
    "node_values",
    "preview",
    "render",
    "slots_tensor",
    "split_node",
    "walk",
]
