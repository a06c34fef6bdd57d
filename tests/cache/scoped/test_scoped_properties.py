"""Property tests of ScopedRadixCache.

1. Against a reference model (hypothesis, stateful): with promotion off, a principal's visible
   match equals the longest page-aligned prefix it computed itself or that lies on a computed
   pinned prefix; with evictions, it never exceeds that. Every step ends in check_integrity() and
   slot conservation.
2. T5, the two-world differential: an attacker's transcript (the visible match of each of its
   requests, in order) is identical whether the victim sent secret A, secret B or nothing, for
   generated multi-principal workloads with epochs passing, k = 3 or inf, dedup on or off. The
   positive control runs the same script on the global radix cache and sees the worlds differ.
3. Merged and unmerged trees answer every principal identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvscope.cache import EvictParams, RadixCache
from kvscope.cache.scoped import PUBLIC
from kvscope.cache.scoped.node import walk_scoped
from kvscope.mem import make_token_allocator
from tests.cache.scoped.scoped_helpers import Scoped

PRINCIPALS = ["t1/a", "t1/b", "t2/a", None]
PINNED = [1, 2, 3, 4, 5, 6, 7, 8]


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Reference:
    """What each principal may see with promotion off: what it computed, and computed pinned pages."""

    def __init__(self, page_size: int, pinned: Sequence[Sequence[int]]) -> None:
        self.page_size = page_size
        self.pinned = [list(p[: len(p) - len(p) % page_size]) for p in pinned]
        self.computed: dict[str | None, list[list[int]]] = {}

    def allowed(self, prompt: Sequence[int], user: str | None) -> int:
        best = max((lcp(prompt, s) for s in self.computed.get(user, [])), default=0)
        for pin in self.pinned:
            for seqs in self.computed.values():
                for s in seqs:
                    best = max(best, min(lcp(prompt, pin), lcp(prompt, s)))
        return best - best % self.page_size

    def add(self, prompt: Sequence[int], user: str | None) -> None:
        self.computed.setdefault(user, []).append(list(prompt))


prompts = st.lists(st.integers(1, 12), min_size=1, max_size=24)


class ScopedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.page_size = 1
        self.s = Scoped(size=4096, promote_k=None, pinned=[PINNED])
        self.ref = Reference(self.page_size, [PINNED])
        self.evicted = False

    @rule(prompt=prompts, user=st.sampled_from(PRINCIPALS), pinned=st.booleans())
    def serve(self, prompt: list[int], user: str | None, pinned: bool) -> None:
        prompt = (PINNED[: len(prompt) % 9] + prompt) if pinned else prompt
        cached = self.s.serve(prompt, user)
        allowed = self.ref.allowed(prompt, user)
        assert cached <= allowed, (cached, allowed)  # never more than the principal may know
        if not self.evicted:
            assert cached == allowed
        self.ref.add(prompt, user)

    @rule(prompt=prompts, user=st.sampled_from(PRINCIPALS))
    def probe(self, prompt: list[int], user: str | None) -> None:
        cached = self.s.probe(prompt, user)
        allowed = self.ref.allowed(prompt, user)
        assert cached <= allowed and (self.evicted or cached == allowed)

    @rule(num_tokens=st.integers(1, 40))
    def evict(self, num_tokens: int) -> None:
        n = min(num_tokens, self.s.cache.evictable_size())
        if n:
            self.s.cache.evict(EvictParams(n))
            self.evicted = True

    @rule()
    def next_epoch(self) -> None:
        self.s.tick_epoch()

    @invariant()
    def intact(self) -> None:
        self.s.cache.check_integrity()
        self.s.conserved()


TestScopedAgainstReference = ScopedMachine.TestCase
TestScopedAgainstReference.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# -- T5: two worlds ----------------------------------------------------------------------------

SECRET_ALPHABET = list(range(20, 30))  # background prompts never use these tokens
PUBLIC_PREFIX = [40, 41, 42, 43, 44, 45]
VICTIM = "victim/v"


def world(
    cache_kind: str, secret: list[int] | None, script: list[tuple[str, Any]], promote_k: int | None, dedup: bool
) -> list[int]:
    """Run `script` with the victim sending PUBLIC_PREFIX + secret first (None: no secret); the
    attacker's transcript."""
    if cache_kind == "radix":
        allocator = make_token_allocator(8192, 1, "cpu")
        cache: Any = RadixCache(allocator, 1, strict=True)
        s = None
    else:
        s = Scoped(size=8192, promote_k=promote_k, dedup=dedup, pinned=[PUBLIC_PREFIX])
        cache, allocator = s.cache, s.allocator
    counter = [0]

    def serve(prompt: list[int], user: str) -> int:
        counter[0] += 1
        ids = np.asarray(prompt, dtype=np.int32)
        match = cache.match_prefix(ids, user, rid=f"r{counter[0]}")
        cache.inc_lock_ref(match.last_node)
        new = allocator.alloc(len(ids) - match.prefix_len)
        slots = torch.cat((match.device_indices, new))
        inserted = cache.insert(ids, slots, user)
        allocator.free(slots[match.prefix_len : inserted])
        cache.dec_lock_ref(match.last_node)
        cache.check_integrity()
        return match.prefix_len

    # NOTE: "nothing" is the victim sending the public prefix alone: whether anyone computed a
    # pinned prefix is public by definition (the threat model's stated exception), its secret is not
    serve(PUBLIC_PREFIX + (secret or []), VICTIM)
    transcript = []
    for op, arg in script:
        if op == "tick":
            if s is not None:
                s.tick_epoch()
        elif op == "background":
            user, prompt = arg
            serve(prompt, user)
        else:
            transcript.append(serve(arg, "attacker/x"))
    return transcript


background = st.tuples(
    st.sampled_from(["t1/a", "t1/b", "t2/a"]),
    st.lists(st.integers(1, 12), min_size=1, max_size=12).map(lambda p: PUBLIC_PREFIX[:3] + p),
)
attack = st.lists(st.sampled_from(SECRET_ALPHABET), min_size=1, max_size=4).map(lambda g: PUBLIC_PREFIX + g)
scripts = st.lists(
    st.one_of(
        st.tuples(st.just("tick"), st.none()),
        st.tuples(st.just("background"), background),
        st.tuples(st.just("attack"), attack),
    ),
    min_size=1,
    max_size=25,
)
secrets = st.lists(st.sampled_from(SECRET_ALPHABET), min_size=2, max_size=4)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts, secret_a=secrets, secret_b=secrets, promote_k=st.sampled_from([3, None]), dedup=st.booleans())
def test_t5_the_attackers_transcript_is_the_same_whatever_the_victim_sent(
    script: list[tuple[str, Any]], secret_a: list[int], secret_b: list[int], promote_k: int | None, dedup: bool
) -> None:
    a = world("scoped", secret_a, script, promote_k, dedup)
    b = world("scoped", secret_b, script, promote_k, dedup)
    nothing = world("scoped", None, script, promote_k, dedup)
    assert a == b == nothing


def test_t5_control_under_global_sharing_the_worlds_differ() -> None:
    script: list[tuple[str, Any]] = [("attack", [*PUBLIC_PREFIX, 21, 22])]
    assert world("radix", [21, 22], script, None, False) != world("radix", [23, 24], script, None, False)
    # and the scoped cache serves the public prefix to the attacker in both (it is not blind)
    assert world("scoped", [21, 22], script, 3, False) == [len(PUBLIC_PREFIX)]


# -- merged vs unmerged -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["t1/a", "t2/b"]), st.lists(st.integers(1, 6), min_size=1, max_size=16), st.booleans()
        ),
        min_size=1,
        max_size=20,
    ),
    probes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=16), min_size=1, max_size=10),
)
def test_merged_and_unmerged_trees_answer_every_principal_identically(
    ops: list[tuple[str, list[int], bool]], probes: list[list[int]]
) -> None:
    merged, plain = Scoped(promote_k=2, merge_chains=True), Scoped(promote_k=2)
    for user, prompt, tick in ops:
        for s in (merged, plain):
            s.serve(prompt, user)
            if tick:
                s.tick_epoch()
    for probe in probes:
        for user in ("t1/a", "t2/b", "t3/c"):
            assert merged.probe(probe, user) == plain.probe(probe, user)
    merged.cache.check_integrity()
    plain.cache.check_integrity()


def test_every_promotion_had_k_creators() -> None:
    s = Scoped(promote_k=3)
    for user in ("a", "b"):
        s.serve([*PUBLIC_PREFIX, 1, 2], user)
    s.serve([*PUBLIC_PREFIX, 1, 3], "c")
    s.tick_epoch()
    publics = [n for n, _, _ in walk_scoped(s.cache.root) if n.visibility == PUBLIC and n is not s.cache.root]
    assert [len(n.value) for n in publics] == [len(PUBLIC_PREFIX) + 1]  # a, b, c all computed prefix + [1]
    assert s.probe([*PUBLIC_PREFIX, 1, 2], "e") == len(PUBLIC_PREFIX) + 1  # [.., 2]: only a and b
    s.serve([*PUBLIC_PREFIX, 1, 2], "d")
    s.serve([*PUBLIC_PREFIX, 1, 4], "f")
    s.tick_epoch()  # a, b (the previous epoch) and d (this one) computed prefix + [1, 2]; only f, [1, 4]
    assert s.probe([*PUBLIC_PREFIX, 1, 2], "e") == len(PUBLIC_PREFIX) + 2
    assert s.probe([*PUBLIC_PREFIX, 1, 4], "e") == len(PUBLIC_PREFIX) + 1
    s.cache.check_integrity()
