"""The workload registry: a name -> a seeded generator of TraceRequests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscope.workloads.generators_prefix import few_shot, random_prompts, shared_prefix
from kvscope.workloads.generators_session import multi_tenant, multi_turn
from kvscope.workloads.generators_tree import branching
from kvscope.workloads.request import TraceRequest

WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "branching": branching,
    "random": random_prompts,
    "multi-tenant": multi_tenant,
}


def generate(
    name: str, *, num_requests: int, seed: int = 0, vocab_size: int = 512, **options: Any
) -> list[TraceRequest]:
    """`num_requests` requests of workload `name`, the same for the same arguments.

    Common arguments: `seed` (>= 0) picks the random stream; token ids are drawn from
    [NUM_SPECIAL, vocab_size), never a special id; `rate_per_s` (default None) gives Poisson
    arrivals at that rate in `arrival_s` (None: all arrive at once), from a stream of their
    own so the tokens do not change with it. `options` are the workload's own keywords
    (see each generator's docstring); an unknown one is a TypeError.
    """
    generator = WORKLOADS.get(name)
    if generator is None:
        raise ValueError(f"unknown workload {name!r}; valid names: {', '.join(WORKLOADS)}")
    return generator(num_requests=num_requests, seed=seed, vocab_size=vocab_size, **options)
