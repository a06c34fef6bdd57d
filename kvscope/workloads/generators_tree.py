"""Branching (tree-of-thought) workloads: a tree of prefixes per problem."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from kvscope.workloads.request import TraceRequest
from kvscope.workloads.sampling import TokenSource, arrival_times, check_common, check_int, check_ints


class Node(NamedTuple):
    """A tree node waiting to be emitted: its path ("r", "r.2", "r.2.0") and prompt."""

    path: str
    depth: int
    prompt_ids: np.ndarray


def branching(
    *,
    num_requests: int,
    seed: int = 0,
    vocab_size: int = 512,
    rate_per_s: float | None = None,
    root_prompt_len: int = 96,
    branch_factor: int = 3,
    max_depth: int = 3,
    branch_len: int = 16,
    output_len: int = 16,
    num_users: int = 4,
) -> list[TraceRequest]:
    """Trees of thought: every node is a request whose forced output is its "thought"; a
    child's prompt = its parent's prompt + the parent's output + the child's own tokens.

    Nodes are emitted tree by tree in breadth-first order, so a parent always comes before
    its children. A tree is full at depth `max_depth` (1 + b + ... + b**max_depth nodes);
    the next request then starts a new tree with a new root prompt.

    Options (default):
        root_prompt_len (96)     tokens of each tree's root prompt, exact
        branch_factor (3)        children per node
        max_depth (3)            depth of the deepest nodes (the root is depth 0)
        branch_len (16)          a child's own tokens after its parent's context, varies ±50%
        output_len (16)          forced output tokens per node, varies ±50%
        num_users (4)            each tree's user drawn from "u0".."u{num_users-1}"
    Request ids: "br-t0-r" (root of tree 0), "br-t0-r.2.0" (child 0 of its child 2).
    """
    check_common(num_requests, seed, vocab_size, rate_per_s)
    check_ints(1, root_prompt_len=root_prompt_len, branch_factor=branch_factor, branch_len=branch_len)
    check_ints(1, output_len=output_len, num_users=num_users)
    check_int("max_depth", max_depth, minimum=0)
    source = TokenSource(seed, vocab_size)
    arrivals = arrival_times(seed, num_requests, rate_per_s)
    pending: deque[Node] = deque()
    num_trees, user = 0, ""
    requests = []
    for i in range(num_requests):
        if not pending:
            pending.append(Node("r", 0, source.tokens(root_prompt_len)))
            num_trees, user = num_trees + 1, f"u{source.pick(num_users)}"
        node = pending.popleft()
        output_ids = source.varied_tokens(output_len)
        rid = f"br-t{num_trees - 1}-{node.path}"
        requests.append(TraceRequest(rid, user, node.prompt_ids, output_ids.size, output_ids, arrivals[i]))
        if node.depth < max_depth:
            context = np.concatenate((node.prompt_ids, output_ids))
            for b in range(branch_factor):
                child_prompt = np.concatenate((context, source.varied_tokens(branch_len)))
                pending.append(Node(f"{node.path}.{b}", node.depth + 1, child_prompt))
    return requests
