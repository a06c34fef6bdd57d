"""Nodes of the scoped radix tree: SGLang's tree node plus who may see it.

NOTE: a node's state on top of NodeBase (docs/isolation.md)
    visibility   "private" (only `holders` see it), "public" (promoted), "pinned" (an operator's
                 declared prefix: public from birth)
    holders      principals that may see a private node: its owner, and with dedup on every
                 principal that computed the same tokens and shares its pages
    hits         hits in the epoch window by principal (the anomaly monitor reads them)
    path_hash    the creator ledger's chain hash of the whole path from the root to the node's end
    tombstone    demoted: invisible to everyone; freed when its last lock drops
Children are *copies*: `children[first page]` is a list, at most one public or pinned copy and
any number of private ones, each in its holders' namespace. A principal sees the copies
visible to it; no other copy is touched, counted or split on its behalf.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvscope.cache.scoped.creators import ROOT_HASH
from kvscope.cache.scoped.window import Window
from kvscope.cache.tree import EMPTY_SLOTS, NodeBase
from kvscope.telemetry import Visibility

PRIVATE, PUBLIC, PINNED = Visibility.PRIVATE, Visibility.PUBLIC, Visibility.PINNED
VISIBILITIES = tuple(Visibility)


class ScopedNode(NodeBase):
    __slots__ = ("children", "hits", "holders", "path_hash", "tombstone", "value", "visibility")

    def __init__(self, key: bytes = b"", value: np.ndarray = EMPTY_SLOTS, now: float = 0.0) -> None:
        super().__init__(key, now)
        self.children: dict[bytes, list[ScopedNode]] = {}  # NOTE: copies, not one child
        self.value = value
        self.visibility: Visibility = PUBLIC  # NOTE: the root's; a new node gets PRIVATE or PINNED
        self.tombstone = False
        self.holders: frozenset[str] = frozenset()
        self.hits = Window()
        self.path_hash = ROOT_HASH

    def copies(self) -> Iterator[ScopedNode]:
        for copies in self.children.values():
            yield from copies

    def num_children(self) -> int:
        return sum(len(copies) for copies in self.children.values())

    def sees(self, principal: str) -> bool:
        """Whether `principal` may see this node (the root: everyone)."""
        return not self.tombstone and (self.visibility != PRIVATE or principal in self.holders)

    def __repr__(self) -> str:
        return (
            f"ScopedNode(id={self.id}, tokens={len(self.value)}, {self.visibility}, owner={self.owner!r}, "
            f"lock_ref={self.lock_ref})"
        )


def detach_copy(leaf: ScopedNode, page_bytes: int) -> None:
    """Take `leaf` out of its parent's copies under its first page."""
    parent = leaf.parent
    assert parent is not None
    first = leaf.key[:page_bytes]
    copies = parent.children[first]
    copies.remove(leaf)
    if not copies:
        del parent.children[first]


def is_scoped_leaf(node: ScopedNode) -> bool:
    """An unlocked node is an evictable leaf when it has no copies below and is no tombstone."""
    return not node.children and not node.tombstone


def principal_key(user: str | None) -> str:
    """The principal a request's `user` names; requests without one share the anonymous principal ""."""
    return user if user is not None else ""


def walk_scoped(root: ScopedNode) -> list[tuple[ScopedNode, int, int]]:
    """(node, depth in nodes, depth in tokens at the node's start), depth-first, root first."""
    out: list[tuple[ScopedNode, int, int]] = []
    stack: list[tuple[ScopedNode, int, int]] = [(root, 0, 0)]
    while stack:
        node, depth, start = stack.pop()
        out.append((node, depth, start))
        end = start + len(node.value)
        stack += [(c, depth + 1, end) for c in reversed(list(node.copies()))]
    return out


def path_values(node: ScopedNode) -> list[np.ndarray]:
    """The slot arrays of the path from the root down to `node`, root side first."""
    values = []
    while node.parent is not None:
        values.append(node.value)
        node = node.parent
    return values[::-1]
