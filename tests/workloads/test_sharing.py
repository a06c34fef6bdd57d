"""Each generator's sharing structure holds: who shares which prefix with whom."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import numpy as np

from kvscope.workloads import ByteTokenizer, generate
from tests.workloads.helpers import (
    common_prefix_len,
    context_of,
    group_turns,
    max_pairwise_common_prefix_len,
    starts_with,
)


def test_shared_prefix_requests_start_with_one_of_the_system_prompts() -> None:
    requests = generate("shared-prefix", num_requests=120, seed=1, num_system_prompts=3, system_prompt_len=40)
    heads = Counter(r.prompt_ids[:40].tobytes() for r in requests)
    assert len(heads) == 3, f"expected 3 system prompts, found {len(heads)}"
    suffixes = [r.prompt_ids[40:] for r in requests]
    assert all(len(s) >= 16 for s in suffixes)
    assert len({s.tobytes() for s in suffixes}) == len(requests), "suffixes are the requests' own"
    assert all(r.output_ids is None for r in requests)


def test_multi_turn_turn_extends_the_previous_prompt_and_output() -> None:
    requests = generate("multi-turn", num_requests=80, seed=2, num_turns=4, max_open_conversations=3)
    conversations = group_turns(requests, r"mt-(?P<key>c\d{4})-t(?P<turn>\d+)")
    assert len(conversations) >= 80 // 4
    for key, turns in conversations.items():
        assert [t for t, _ in turns] == list(range(len(turns))) and len(turns) <= 4, key
        assert len({r.user for _, r in turns}) == 1, f"{key} changes user"
        for (_, earlier), (_, later) in itertools.pairwise(turns):
            assert starts_with(later.prompt_ids, context_of(earlier)), f"{later.rid} does not extend {earlier.rid}"
            assert later.prompt_len > len(context_of(earlier))


def test_multi_turn_interleaves_open_conversations_behind_one_system_prompt() -> None:
    requests = generate("multi-turn", num_requests=60, seed=3, max_open_conversations=4, system_prompt_len=20)
    keys = [r.rid.split("-")[1] for r in requests]
    switches = sum(a != b for a, b in itertools.pairwise(keys))
    assert switches > len(requests) // 2, "turns of open conversations should interleave"
    assert len({r.prompt_ids[:20].tobytes() for r in requests}) == 1
    first_turns = [r.prompt_ids for r in requests if r.rid.endswith("-t0")]
    assert max_pairwise_common_prefix_len(first_turns) < 20 + 3


def test_few_shot_prompts_share_the_instruction_and_pool_examples_at_several_depths() -> None:
    instruction_len, example_len, k = 30, 12, 3
    requests = generate(
        "few-shot",
        num_requests=80,
        seed=4,
        instruction_len=instruction_len,
        num_examples=5,
        examples_per_prompt=k,
        example_len=example_len,
    )
    prompts = [r.prompt_ids for r in requests]
    assert len({p[:instruction_len].tobytes() for p in prompts}) == 1
    examples = [
        [p[instruction_len + j * example_len : instruction_len + (j + 1) * example_len].tobytes() for j in range(k)]
        for p in prompts
    ]
    assert all(len(set(chosen)) == k for chosen in examples), "a prompt repeats an example"
    assert len({e for chosen in examples for e in chosen}) == 5, "examples come from the pool of 5"
    before = {(a, b) for chosen in examples for a, b in itertools.combinations(chosen, 2)}
    assert not any((b, a) in before for a, b in before), "examples keep one pool order in every prompt"
    depths = {(common_prefix_len(a, b) - instruction_len) // example_len for a in prompts[:20] for b in prompts[20:40]}
    assert {0, 1, 2} <= depths, f"sharing depths in whole examples: {sorted(depths)}"


def test_branching_children_extend_their_parent_context() -> None:
    requests = generate("branching", num_requests=100, seed=5, branch_factor=3, max_depth=3)
    by_rid = {r.rid: (i, r) for i, r in enumerate(requests)}
    roots = [r for r in requests if r.rid.endswith("-r")]
    assert len(roots) == 3, "a full tree has 1 + 3 + 9 + 27 = 40 nodes"
    for i, request in enumerate(requests):
        match = re.fullmatch(r"br-(t\d+)-(r(?:\.\d)*)", request.rid)
        assert match, request.rid
        tree, path = match.groups()
        assert path.count(".") <= 3
        if path == "r":
            continue
        parent_index, parent = by_rid[f"br-{tree}-{path.rsplit('.', 1)[0]}"]
        assert parent_index < i and parent.user == request.user
        assert starts_with(request.prompt_ids, context_of(parent)), f"{request.rid} does not extend its parent"
    assert max_pairwise_common_prefix_len([r.prompt_ids for r in roots]) < 3


def test_branching_siblings_share_exactly_their_parent_context() -> None:
    requests = generate("branching", num_requests=13, seed=6, branch_factor=3, max_depth=2)
    root, children = requests[0], requests[1:4]
    for a, b in itertools.pairwise(children):
        assert common_prefix_len(a.prompt_ids, b.prompt_ids) >= len(context_of(root))
        assert not np.array_equal(a.prompt_ids, b.prompt_ids)


def test_random_prompts_share_no_prefix() -> None:
    requests = generate("random", num_requests=150, seed=7)
    assert max_pairwise_common_prefix_len([r.prompt_ids for r in requests]) == 0


def test_random_prompts_over_a_tiny_vocabulary_share_at_most_two_tokens() -> None:
    vocab_size = ByteTokenizer.num_special + 5  # 5 usable ids: 125 >= 60 distinct 3-token heads
    requests = generate("random", num_requests=60, seed=8, vocab_size=vocab_size)
    assert max_pairwise_common_prefix_len([r.prompt_ids for r in requests]) <= 2


def test_multi_tenant_prompts_start_with_the_common_then_the_tenant_prompt() -> None:
    common_len, tenant_len = 20, 30
    requests = generate(
        "multi-tenant",
        num_requests=120,
        seed=9,
        num_tenants=3,
        users_per_tenant=2,
        common_prompt_len=common_len,
        tenant_prompt_len=tenant_len,
    )
    assert len({r.prompt_ids[:common_len].tobytes() for r in requests}) == 1
    tenant_prompts: dict[str, set[bytes]] = {}
    for r in requests:
        assert r.user is not None and re.fullmatch(r"t[0-2]-u[01]", r.user), r.user
        tenant_prompts.setdefault(r.user.split("-")[0], set()).add(
            r.prompt_ids[common_len : common_len + tenant_len].tobytes()
        )
    assert all(len(prompts) == 1 for prompts in tenant_prompts.values()), "one prompt per tenant"
    assert len(set.union(*tenant_prompts.values())) == 3, "tenants have their own prompts"


def test_multi_tenant_sessions_extend_the_users_earlier_requests() -> None:
    requests = generate("multi-tenant", num_requests=120, seed=10, turns_per_session=3)
    sessions = group_turns(requests, r"mten-(?P<key>t\d+-u\d+-s\d+)-t(?P<turn>\d+)")
    assert any(key.endswith("-s1") for key in sessions), "users start new sessions"
    for key, turns in sessions.items():
        assert [t for t, _ in turns] == list(range(len(turns))) and len(turns) <= 3, key
        assert all(r.user == key.rsplit("-", 1)[0] for _, r in turns)
        for (_, earlier), (_, later) in itertools.pairwise(turns):
            assert starts_with(later.prompt_ids, context_of(earlier)), f"{later.rid} does not extend {earlier.rid}"
