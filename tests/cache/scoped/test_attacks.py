"""Prompt-stealing attacks on the scoped cache, in process (docs/isolation.md, "Security property,
and its honest limit": T2 the hit oracle, T3 the lpm order oracle, T4 the sybil bound; the harness
is attack_harness.py). Every attack that must fail is paired with one that must succeed: the same
attack code against global sharing, the victim's own repeat, the public prefix for everyone,
or a promotion that an outsider can see."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import MODEL_PRESETS
from kvscope.engine.request import Req
from tests.cache.scoped.attack_harness import (
    DIGITS,
    FILLER,
    PUBLIC_PREFIX,
    SECRET_LEN,
    Attacker,
    Server,
    global_cache,
    num_correct,
    probe,
    recover,
    scoped_cache,
    search_position,
)

SECRETS = st.tuples(*[st.sampled_from(DIGITS)] * SECRET_LEN)
VICTIM_PROMPT_LEN = len(PUBLIC_PREFIX) + SECRET_LEN


def victim_sends(server: Server, secret: tuple[int, ...], user: str = "victim") -> int:
    return server.serve((*PUBLIC_PREFIX, *secret), user)


def assert_controls(server: Server, secret: tuple[int, ...], attacker: Attacker) -> None:
    """The victim's repeat hits all but the last token (the engine always computes that one);
    the public prefix hits for the attacker."""
    assert victim_sends(server, secret) == VICTIM_PROMPT_LEN - 1
    assert attacker.send((*PUBLIC_PREFIX, FILLER)) == len(PUBLIC_PREFIX)


# -- T2: the hit-oracle attacker ---------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(secret=SECRETS)
def test_attack_recovers_every_digit_under_global_sharing(secret: tuple[int, ...]) -> None:
    """The positive control for the attack code: with one tree for everyone, 6 of 6."""
    server = global_cache()
    victim_sends(server, secret)
    attacker = Attacker(server, "t2/attacker")
    assert recover(attacker) == secret
    assert_controls(server, secret, attacker)


@pytest.mark.parametrize("dedup", [False, True])
@settings(max_examples=10, deadline=None)
@given(secret=SECRETS)
def test_isolation_hides_every_digit(dedup: bool, secret: tuple[int, ...]) -> None:
    """promote_k = inf: 0 of 6, and every probe shows exactly the pinned prefix (dedup on: the
    attacker joins the holders of what it computed itself, and still sees nothing more)."""
    server = scoped_cache(promote_k=None, dedup=dedup)
    victim_sends(server, secret)
    attacker = Attacker(server, "t2/attacker")
    before = server.num_prefills
    assert recover(attacker) == ()
    assert server.num_prefills - before == len(DIGITS)  # the whole alphabet at position 0, no hit
    for i, digit in enumerate(secret):  # a fresh principal per probe: no copies of its own
        assert server.serve(probe(PUBLIC_PREFIX, digit), f"t3/fresh-{i}") == len(PUBLIC_PREFIX)
    assert_controls(server, secret, attacker)


def test_one_account_learns_nothing_over_many_epochs() -> None:
    """promote_k = 3, one attacker account, the victim re-sending every epoch, an epoch between
    probes, five passes (50 epochs): 0 of 6, and nothing is ever promoted (only two creators)."""
    secret = (103, 107, 100, 109, 104, 101)
    server = scoped_cache(promote_k=3)
    attacker = Attacker(server, "t2/attacker")

    def next_epoch() -> None:
        server.next_epoch()
        assert victim_sends(server, secret) == VICTIM_PROMPT_LEN - 1

    victim_sends(server, secret)
    for _ in range(5):
        assert search_position(attacker, PUBLIC_PREFIX, between=next_epoch) is None
    assert server.scoped.epoch() == 50
    assert server.scoped.stats().promotions == 0
    assert_controls(server, secret, attacker)


def test_three_creators_promote_for_an_outsider() -> None:
    """The control for the test above: two principals compute the same tokens in epoch 0, a third
    in epoch 1 (it sees only P then: two creators are not enough); at the next boundary the
    tokens are public, visible to a principal that never sent them."""
    server = scoped_cache(promote_k=3)
    shared = (*PUBLIC_PREFIX, 103, 107, FILLER)
    for user in ("t1/a", "t1/b"):
        server.serve(shared, user)
    server.next_epoch()
    assert server.serve(shared, "t9/outsider") == len(PUBLIC_PREFIX)  # two creators: still private
    server.next_epoch()
    assert server.serve(shared, "t8/outsider") == len(shared) - 1
    assert server.scoped.stats().promotions == 1


def test_own_copies_fool_a_naive_attacker() -> None:
    """Why the attacker tracks its own prompts: its probes are cached for itself, so a second
    pass that reads any hit as evidence "recovers" its own first guess. The tracking attacker
    reads nothing there, and still recovers 6 of 6 under global sharing (the tests above)."""
    secret = (105, 101, 100, 109, 104, 101)
    server = scoped_cache(promote_k=None)
    victim_sends(server, secret)
    tracking = Attacker(server, "t2/attacker")
    assert recover(tracking) == ()
    naive = Attacker(server, "t2/attacker", tracks_own=False, sent=tracking.sent)
    naive_guess = recover(naive)
    assert naive_guess[:1] == (DIGITS[0],) and num_correct(naive_guess, secret) == 0
    assert recover(tracking) == ()
    assert_controls(server, secret, tracking)


# -- T3: the scheduler's order as an oracle ------------------------------------------------
# NOTE: one request admitted per step (max_running_requests=1, max_new_tokens=1: each one
# finishes in its prefill), so a request's admission step is its rank, and the completion order
# is the same. Under lpm the waiting queue is sorted by visible match, longest first.

SECRET_A = (103, 107, 100, 109, 104, 101)
SECRET_B = (106, 102, 108, 100, 105, 103)


def lpm_engine(kind: str, promote_k: int | None = None) -> Engine:
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=4096, max_running_requests=1, max_context_len=128),
        cache=CacheConfig(kind=kind, promote_k=promote_k, pinned=(PUBLIC_PREFIX,)),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(chunked_prefill_size=None, schedule_policy="lpm"),
        device="cpu",
        strict=True,
    )
    return Engine(config, MODEL_PRESETS["tiny"])


def drain(engine: Engine) -> None:
    """Step until idle, then once more for the idle leak check; check every pool and the cache."""
    while not engine.scheduler.is_idle():
        engine.step()
    engine.step()
    assert engine.stats.leak_checks_failed == 0 and engine.stats.leak_checks_passed >= 1
    engine.check_integrity()


def request(rid: str, prompt: tuple[int, ...], user: str) -> Req:
    return Req(rid, np.array(prompt, dtype=np.int32), 1, user=user)


def order_oracle(
    kind: str, secret: tuple[int, ...] | None, promote_k: int | None = None
) -> tuple[list[str], dict[str, int]]:
    """A third principal warms P; the victim (if any) sends P + secret and finishes; then the
    attacker submits at once a dummy, the 10 guesses P + [d, FILLER], another dummy. The
    attacker's transcript: its requests in admission order (= completion order), and the
    cached tokens of each."""
    engine = lpm_engine(kind, promote_k)
    engine.submit(request("warm", (*PUBLIC_PREFIX, FILLER), "t0/ops"))
    if secret is not None:
        engine.submit(request("victim", (*PUBLIC_PREFIX, *secret), "t1/victim"))
    drain(engine)
    batch = [request("dummy-1", (501, *range(400, 420)), "t2/attacker")]
    batch += [request(f"guess-{d}", probe(PUBLIC_PREFIX, d), "t2/attacker") for d in DIGITS]
    batch.append(request("dummy-2", (502, *range(400, 420)), "t2/attacker"))
    for req in batch:
        engine.submit(req)
    drain(engine)
    admitted = {r.rid: engine.stats.records[r.rid].steps["admit"] for r in batch}
    finished = {r.rid: engine.stats.records[r.rid].steps["finish"] for r in batch}
    assert len(set(admitted.values())) == len(batch)  # one admission a step
    order = sorted(admitted, key=admitted.__getitem__)
    assert sorted(finished, key=finished.__getitem__) == order  # completions come in the same order
    return order, {r.rid: r.cached_tokens for r in batch}


@pytest.mark.parametrize("promote_k", [None, 3])
def test_lpm_order_does_not_depend_on_the_secret(promote_k: int | None) -> None:
    """Scoped: secret A, secret B and no victim give the same order and cached tokens: the guesses
    (P each, pinned) in arrival order, then the dummies. Within one epoch, k = 3 is inf."""
    order, cached = order_oracle("scoped-radix", SECRET_A, promote_k)
    assert (order, cached) == order_oracle("scoped-radix", SECRET_B, promote_k)
    assert (order, cached) == order_oracle("scoped-radix", None, promote_k)
    assert order == [f"guess-{d}" for d in DIGITS] + ["dummy-1", "dummy-2"]
    assert {cached[f"guess-{d}"] for d in DIGITS} == {len(PUBLIC_PREFIX)}  # P hits: not a blind cache


def test_lpm_order_leaks_the_secret_under_global_sharing() -> None:
    """The positive control: with one tree for everyone, the guess of the secret's first digit
    matches one token more and is admitted first, so the order names the digit."""
    order_a, cached_a = order_oracle("radix", SECRET_A)
    order_b, _ = order_oracle("radix", SECRET_B)
    assert order_a[0] == f"guess-{SECRET_A[0]}" and order_b[0] == f"guess-{SECRET_B[0]}"
    assert order_a != order_b
    assert cached_a[f"guess-{SECRET_A[0]}"] == len(PUBLIC_PREFIX) + 1
    no_victim, _ = order_oracle("radix", None)
    assert no_victim == [f"guess-{d}" for d in DIGITS] + ["dummy-1", "dummy-2"]


# -- T4: the sybil bound -------------------------------------------------------------------
# NOTE: what the numbers below pin (promote_k = 3, dedup off, one victim principal)
#   - Promotion needs k = 3 creators in the window: the victim plus 2 coalition accounts that
#     compute every guess. The creator ledger holds no KV, so it remembers them after eviction.
#   - A creator keeps a private copy of each guess it computed, so while that copy is cached its
#     visible match is the same for the right digit (public now) and the wrong ones (its own):
#     it cannot read the promotion. Once its copies are evicted it can, and k - 1 = 2 accounts
#     recover the secret (the note's bound). Without that eviction, reading takes a third
#     account that never computed the guess (2 creators + 1 observer).
#   - The victim's record counts at the next two boundaries only (its repeats hit its own copy
#     and record nothing): one computation by the victim yields 2 digits; 6 of 6 needs the victim
#     to recompute once per epoch (here: memory pressure evicts its copy).

SYBIL_SECRET = (103, 107, 100, 109, 104, 101)
PROBES_TO_HIT = sum(DIGITS.index(d) + 1 for d in SYBIL_SECRET)  # 4 + 8 + 1 + 10 + 5 + 2 = 30
GUESS_PREFILLS = 2 * len(DIGITS) * SECRET_LEN  # 120: 2 creators x 10 digits x 6 positions


def compute_guesses(creators: list[Attacker], prefix: tuple[int, ...]) -> None:
    for attacker in creators:
        for digit in DIGITS:
            attacker.send(probe(prefix, digit))


def sybil_attack(
    server: Server,
    creators: list[Attacker],
    observer: Attacker,
    *,
    victim_recomputes: bool,
    evict_guesses: bool = False,
) -> tuple[int, ...]:
    """One epoch per position: [memory pressure evicts everything; the victim recomputes its
    prompt;] every creator computes all 10 guesses; [evict_guesses: pressure again, the creators
    know their copies are gone, the victim recomputes;] the clock crosses a boundary (promotion);
    the observer walks the digits until one hits."""
    if not victim_recomputes:
        victim_sends(server, SYBIL_SECRET)
    recovered: tuple[int, ...] = ()
    while len(recovered) < SECRET_LEN:
        if victim_recomputes:
            server.flush()
            assert victim_sends(server, SYBIL_SECRET) == 0
        prefix = (*PUBLIC_PREFIX, *recovered)
        compute_guesses(creators, prefix)
        if evict_guesses:
            server.flush()
            for creator in creators:
                creator.forget()
            assert victim_sends(server, SYBIL_SECRET) == 0
        server.next_epoch()
        digit = search_position(observer, prefix)
        if digit is None:
            break
        recovered = (*recovered, digit)
    return recovered


def test_sybil_bound_two_accounts_recover_the_secret_once_their_copies_are_evicted() -> None:
    """The documented failure, pinned: k - 1 = 2 accounts. Per position the pair computes all 10
    guesses, memory pressure evicts everything, the victim recomputes its prompt; at the boundary
    the victim's node turns public up to the right digit (3 creators in the window), and one of
    the pair, its own copies gone, sees it. Cost: 6 of 6 in 6 epochs; 2 x 10 x 6 = 120 guess
    prefills + 30 probes (the prober stops at the first hit: 4 + 8 + 1 + 10 + 5 + 2 for this
    secret) = 150 coalition prefills; the victim computed its prompt 12 times."""
    server = scoped_cache(promote_k=3)
    creators = [Attacker(server, "t7/sybil-1"), Attacker(server, "t7/sybil-2")]
    assert sybil_attack(server, creators, creators[0], victim_recomputes=True, evict_guesses=True) == SYBIL_SECRET
    assert server.scoped.epoch() == SECRET_LEN
    assert sum(len(a.sent) for a in creators) == GUESS_PREFILLS + PROBES_TO_HIT == 150
    assert server.num_prefills == 150 + 2 * SECRET_LEN
    assert server.scoped.stats().promotions >= SECRET_LEN


def test_sybil_bound_one_account_reads_nothing() -> None:
    """The control coalition of 1, same schedule: the victim's prefix never has more than 2
    creators, nothing is promoted, and the 10 probes of the first position all miss: 0 of 6."""
    server = scoped_cache(promote_k=3)
    creator = Attacker(server, "t7/sybil-1")
    assert sybil_attack(server, [creator], creator, victim_recomputes=True, evict_guesses=True) == ()
    assert len(creator.sent) == 2 * len(DIGITS)
    assert server.scoped.stats().promotions == 0


def test_sybil_pair_cannot_read_a_promotion_while_its_copies_are_cached() -> None:
    """Without eviction between their guesses and the probe, the same pair reads 0 of 6 although
    the right digit was promoted: the prober's own copy of every guess answers like the public
    node. Control: an outsider that never computed the guesses sees the promoted digit."""
    server = scoped_cache(promote_k=3)
    creators = [Attacker(server, "t7/sybil-1"), Attacker(server, "t7/sybil-2")]
    assert sybil_attack(server, creators, creators[0], victim_recomputes=True) == ()
    assert server.scoped.stats().promotions >= 1
    outsider = Attacker(server, "t9/outsider")
    assert search_position(outsider, PUBLIC_PREFIX) == SYBIL_SECRET[0]


def test_sybil_bound_two_creators_and_an_observer_recover_the_secret() -> None:
    """No eviction of the coalition's copies, so the coalition adds a third account that only
    probes. The victim recomputes once per epoch. Cost: 6 of 6 in 6 epochs, 120 guess prefills
    + 30 observer probes."""
    server = scoped_cache(promote_k=3)
    creators = [Attacker(server, "t7/sybil-1"), Attacker(server, "t7/sybil-2")]
    observer = Attacker(server, "t7/sybil-3")
    assert sybil_attack(server, creators, observer, victim_recomputes=True) == SYBIL_SECRET
    assert server.scoped.epoch() == SECRET_LEN
    assert sum(len(a.sent) for a in creators) == GUESS_PREFILLS
    assert len(observer.sent) == PROBES_TO_HIT
    assert server.num_prefills == GUESS_PREFILLS + PROBES_TO_HIT + SECRET_LEN


def test_sybil_bound_without_recomputation_reaches_two_digits() -> None:
    """The victim computes its prompt once (epoch 0): a boundary counts the creators of the two
    epochs before it, so only the guesses computed in epochs 0 and 1 meet the victim's record.
    The same 3 accounts recover exactly 2 of 6; the third position costs all 10 probes."""
    server = scoped_cache(promote_k=3)
    creators = [Attacker(server, "t7/sybil-1"), Attacker(server, "t7/sybil-2")]
    observer = Attacker(server, "t7/sybil-3")
    assert sybil_attack(server, creators, observer, victim_recomputes=False) == SYBIL_SECRET[:2]
    assert len(observer.sent) == DIGITS.index(SYBIL_SECRET[0]) + 1 + DIGITS.index(SYBIL_SECRET[1]) + 1 + 10


def test_sybil_one_creator_and_an_observer_read_nothing() -> None:
    """A coalition of 2 split the other way: 1 creator + 1 observer gives the victim's prefix
    only 2 creators in the window, so nothing is promoted before the observer probes: 0 of 6."""
    server = scoped_cache(promote_k=3)
    creator, observer = Attacker(server, "t7/sybil-1"), Attacker(server, "t7/sybil-3")
    assert sybil_attack(server, [creator], observer, victim_recomputes=True) == ()
    assert len(observer.sent) == len(DIGITS)
