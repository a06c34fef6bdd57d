"""Shared helpers for the workload tests."""

from __future__ import annotations

import itertools
import re

import numpy as np

from kvscope.workloads import TraceRequest


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def max_pairwise_common_prefix_len(prompts: list[np.ndarray]) -> int:
    return max(common_prefix_len(a, b) for a, b in itertools.combinations(prompts, 2))


def context_of(request: TraceRequest) -> np.ndarray:
    """What a request's continuation extends: its prompt followed by its forced output."""
    assert request.output_ids is not None, f"{request.rid} has no forced output"
    return np.concatenate((request.prompt_ids, request.output_ids))


def starts_with(ids: np.ndarray, prefix: np.ndarray) -> bool:
    return len(ids) >= len(prefix) and bool(np.array_equal(ids[: len(prefix)], prefix))


def group_turns(requests: list[TraceRequest], pattern: str) -> dict[str, list[tuple[int, TraceRequest]]]:
    """Requests grouped by the `key` group of `pattern` (matched against the rid), each
    group as (turn, request) in list order."""
    groups: dict[str, list[tuple[int, TraceRequest]]] = {}
    for request in requests:
        match = re.fullmatch(pattern, request.rid)
        assert match, f"rid {request.rid!r} does not match {pattern!r}"
        groups.setdefault(match["key"], []).append((int(match["turn"]), request))
    return groups
