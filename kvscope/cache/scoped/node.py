"""Nodes of the scoped radix tree: SGLang's tree node plus who may see it.

NOTE: a node's state on top of TreeNode (docs/isolation.md)
    visibility   "private" (only `holders` see it), "public" (promoted), "pinned" (an operator's
                 declared prefix: public from birth)
    holders      principals that may see a private node: its owner, and with dedup on every
                 principal that computed the same tokens and shares its pages
    hits         hits in the epoch window by principal (the anomaly monitor reads them)
    path_hash    the creator ledger's chain hash of the whole path from the root to the node's end
Children are *copies*: `children[first page]` is a list, at most one public or pinned copy and
any number of private ones, each in its holders' namespace. A principal sees the copies
visible to it; no other copy is touched, counted or split on its behalf.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvscope.cache.scoped.creators import ROOT_HASH
from kvscope.cache.scoped.window import Window
from kvscope.cache.tree import EMPTY_SLOTS, TreeNode
from kvscope.telemetry import Visibility

PRIVATE, PUBLIC, PINNED = Visibility.PRIVATE, Visibility.PUBLIC, Visibility.PINNED
VISIBILITIES = tuple(Visibility)


class ScopedNode(TreeNode):
    __slots__ = ("hits", "holders", "path_hash")
    parent: ScopedNode | None
    children: dict[bytes, list[ScopedNode]]  # type: ignore[assignment]  # NOTE: copies, not one child

    def __init__(self, key: bytes = b"", value: np.ndarray = EMPTY_SLOTS, now: float = 0.0) -> None:
        super().__init__(key, value, now)
        self.children = {}
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
        return (f"ScopedNode(id={self.id}, tokens={len(self.value)}, {self.visibility}, owner={self.owner!r}, "
                f"lock_ref={self.lock_ref})")


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
