"""Shared pieces for the planning tests: seeded random traces that exercise every radix corner
(mid-node splits, exact repeats, prompts ending inside a node, sub-page tails), an independent
page-level LRU reference for the one-pass curve, and the capacities worth testing."""

from __future__ import annotations

import numpy as np

from kvscope.planning import ReplayRequest


def random_trace(seed: int, num_requests: int, page_size: int, vocab_size: int = 3) -> list[ReplayRequest]:
    """Fresh prompts, extensions of earlier sequences cut anywhere (multi-turn, branching) and
    exact repeats of earlier prompts, over a tiny vocabulary so paths diverge inside nodes."""
    rng = np.random.default_rng([seed, page_size])
    seen: list[np.ndarray] = []
    requests: list[ReplayRequest] = []
    for i in range(num_requests):
        kind = rng.random()
        if seen and kind < 0.15:
            prompt = requests[rng.integers(len(requests))].prompt_ids  # exact repeat
        elif seen and kind < 0.6:
            base = seen[rng.integers(len(seen))]
            cut = int(rng.integers(0, len(base) + 1))
            prompt = np.concatenate((base[:cut], rng.integers(0, vocab_size, rng.integers(1, 3 * page_size + 2))))
        else:
            prompt = rng.integers(0, vocab_size, rng.integers(1, 6 * page_size))
        output = rng.integers(0, vocab_size, rng.integers(1, 3 * page_size))
        all_ids = np.concatenate((prompt, output)).astype(np.int32)
        requests.append(ReplayRequest(f"r{i}", np.asarray(prompt, dtype=np.int32), all_ids))
        seen.append(all_ids)
    return requests


def ceil_pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size) * page_size


def capacities_for(requests: list[ReplayRequest], page_size: int) -> list[int]:
    """Tiny (0, one, two, three pages: smaller than most requests), around the longest request,
    and up to past the whole footprint."""
    longest = max(ceil_pages(r.seq_len, page_size) for r in requests)
    total = sum(ceil_pages(r.seq_len, page_size) for r in requests)
    picks = [0, 1, 2, 3, longest // page_size, longest // page_size + 1]
    picks += [k * longest // page_size for k in (2, 3, 5, 8)] + [total // page_size]
    return sorted({p * page_size for p in picks})


def reference_hits(requests: list[ReplayRequest], capacities: list[int], page_size: int) -> dict[int, list[int]]:
    """The model of docs/capacity-planning.md §6.1 taken literally, page by page, by sorting: items
    are page-prefixes, the key is (last request that touched the page, -depth), a tree of K tokens
    holds the top K/page_size pages before each request, and a prompt hits its leading pages that
    are held."""
    touched: dict[bytes, tuple[int, int]] = {}
    hits: dict[int, list[int]] = {k: [] for k in capacities}
    for i, request in enumerate(requests):
        pages = [request.all_ids[: (j + 1) * page_size].tobytes() for j in range(request.seq_len // page_size)]
        order = sorted(touched, key=lambda key: (-touched[key][0], touched[key][1]))
        rank = {key: r for r, key in enumerate(order)}
        for k in capacities:
            held = 0
            for key in pages[: request.prompt_len // page_size]:
                if key not in rank or rank[key] >= k // page_size:
                    break
                held += page_size
            hits[k].append(held)
        for depth, key in enumerate(pages):
            touched[key] = (i, depth)
    return hits
