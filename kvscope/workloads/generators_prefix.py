"""Single-shot workloads: shared system prompts, few-shot prompts from a shared pool, no sharing.

Every generator takes the common keyword arguments `num_requests`, `seed`, `vocab_size`
and `rate_per_s` (see `generators.generate`) plus its own options; lengths follow the note
in `sampling`. Outputs here are sampled by the engine (`output_ids` is None).
"""

from __future__ import annotations

import numpy as np

from kvscope.workloads.request import TraceRequest
from kvscope.workloads.sampling import TokenSource, arrival_times, check_common, check_ints
from kvscope.workloads.tokenizer import NUM_SPECIAL


def shared_prefix(
    *,
    num_requests: int,
    seed: int = 0,
    vocab_size: int = 512,
    rate_per_s: float | None = None,
    num_system_prompts: int = 4,
    system_prompt_len: int = 128,
    suffix_len: int = 32,
    output_len: int = 16,
    num_users: int = 8,
) -> list[TraceRequest]:
    """Each request = one of a few system prompts (picked uniformly) + a suffix of its own.

    Options (default):
        num_system_prompts (4)   how many distinct system prompts
        system_prompt_len (128)  tokens per system prompt, exact
        suffix_len (32)          the request's own tokens after it, varies ±50%
        output_len (16)          tokens to generate, varies ±50%
        num_users (8)            user of each request drawn from "u0".."u{num_users-1}"
    Request ids: "sp-00000", "sp-00001", ...
    """
    check_common(num_requests, seed, vocab_size, rate_per_s)
    check_ints(
        1,
        num_system_prompts=num_system_prompts,
        system_prompt_len=system_prompt_len,
        suffix_len=suffix_len,
        output_len=output_len,
        num_users=num_users,
    )
    source = TokenSource(seed, vocab_size)
    arrivals = arrival_times(seed, num_requests, rate_per_s)
    system_prompts = [source.tokens(system_prompt_len) for _ in range(num_system_prompts)]
    requests = []
    for i in range(num_requests):
        system_prompt = system_prompts[source.pick(num_system_prompts)]
        prompt_ids = np.concatenate((system_prompt, source.varied_tokens(suffix_len)))
        user = f"u{source.pick(num_users)}"
        requests.append(TraceRequest(f"sp-{i:05d}", user, prompt_ids, source.varied_len(output_len), None, arrivals[i]))
    return requests


def few_shot(
    *,
    num_requests: int,
    seed: int = 0,
    vocab_size: int = 512,
    rate_per_s: float | None = None,
    instruction_len: int = 48,
    num_examples: int = 6,
    examples_per_prompt: int = 3,
    example_len: int = 32,
    question_len: int = 24,
    output_len: int = 8,
    num_users: int = 8,
) -> list[TraceRequest]:
    """Each request = a shared instruction + `examples_per_prompt` distinct examples from a
    shared pool, in pool order + a question of its own.

    Keeping the pool order makes prompts share at different depths: the instruction always,
    then as many examples as their chosen subsets have in common from the front.

    Options (default):
        instruction_len (48)     tokens of the instruction every prompt starts with, exact
        num_examples (6)         size of the example pool
        examples_per_prompt (3)  examples per prompt, distinct, <= num_examples
        example_len (32)         tokens per example, exact
        question_len (24)        the request's own question, varies ±50%
        output_len (8)           tokens to generate, varies ±50%
        num_users (8)            user of each request drawn from "u0".."u{num_users-1}"
    Request ids: "fs-00000", ...
    """
    check_common(num_requests, seed, vocab_size, rate_per_s)
    check_ints(1, instruction_len=instruction_len, num_examples=num_examples, examples_per_prompt=examples_per_prompt)
    check_ints(1, example_len=example_len, question_len=question_len, output_len=output_len, num_users=num_users)
    if examples_per_prompt > num_examples:
        raise ValueError(f"examples_per_prompt ({examples_per_prompt}) must be <= num_examples ({num_examples})")
    source = TokenSource(seed, vocab_size)
    arrivals = arrival_times(seed, num_requests, rate_per_s)
    instruction = source.tokens(instruction_len)
    pool = [source.tokens(example_len) for _ in range(num_examples)]
    requests = []
    for i in range(num_requests):
        chosen = np.sort(source.rng.choice(num_examples, size=examples_per_prompt, replace=False))
        question = source.varied_tokens(question_len)
        prompt_ids = np.concatenate([instruction, *(pool[k] for k in chosen), question])
        user = f"u{source.pick(num_users)}"
        requests.append(TraceRequest(f"fs-{i:05d}", user, prompt_ids, source.varied_len(output_len), None, arrivals[i]))
    return requests


def random_prompts(
    *,
    num_requests: int,
    seed: int = 0,
    vocab_size: int = 512,
    rate_per_s: float | None = None,
    prompt_len: int = 64,
    output_len: int = 16,
    num_users: int = 8,
) -> list[TraceRequest]:
    """Independent random prompts: no prefix sharing at all (the cache's zero-hit baseline).

    No two prompts share their first d tokens, where d is the smallest number with
    (vocab_size - NUM_SPECIAL) ** d >= num_requests (d = 1 unless num_requests exceeds the
    usable vocabulary), so any two prompts have a common prefix shorter than d tokens.

    Options (default):
        prompt_len (64)          tokens per prompt, varies ±50% (never below d)
        output_len (16)          tokens to generate, varies ±50%
        num_users (8)            user of each request drawn from "u0".."u{num_users-1}"
    Request ids: "rnd-00000", ...
    """
    check_common(num_requests, seed, vocab_size, rate_per_s)
    check_ints(1, prompt_len=prompt_len, output_len=output_len, num_users=num_users)
    source = TokenSource(seed, vocab_size)
    arrivals = arrival_times(seed, num_requests, rate_per_s)
    heads = distinct_heads(source, num_requests)
    requests = []
    for i in range(num_requests):
        tail_len = max(0, source.varied_len(prompt_len) - heads.shape[1])
        prompt_ids = np.concatenate((heads[i], source.tokens(tail_len)))
        user = f"u{source.pick(num_users)}"
        requests.append(
            TraceRequest(f"rnd-{i:05d}", user, prompt_ids, source.varied_len(output_len), None, arrivals[i])
        )
    return requests


def distinct_heads(source: TokenSource, num_heads: int) -> np.ndarray:
    """`num_heads` distinct rows of d token ids each, d as small as the vocabulary allows."""
    if num_heads > 1 and source.num_usable < 2:
        raise ValueError(f"vocab_size {source.vocab_size} leaves one usable token; distinct prompts need >= 2")
    head_len = 1
    while source.num_usable**head_len < num_heads:
        head_len += 1
    codes = source.rng.choice(source.num_usable**head_len, size=num_heads, replace=False)
    digits = codes[:, None] // source.num_usable ** np.arange(head_len) % source.num_usable
    return (digits + NUM_SPECIAL).astype(np.int32)
