"""ScopedRadixCache, call by call: T1's invariants (a non-owner's probes of a private node match
nothing and change nothing), epochs and promotion by distinct creators, pinned prefixes, dedup,
demotion by the anomaly monitor, tombstones under locks, chain merging. Every negative is paired
with its positive control, and every test ends in check_integrity()."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvscope.cache import CacheMisuseError, MonitorConfig
from kvscope.cache.scoped import PINNED, PRIVATE, PUBLIC, ScopedNode
from kvscope.cache.scoped.node import walk_scoped
from kvscope.cache.scoped.window import Window
from kvscope.telemetry import EventKind
from tests.cache.scoped.scoped_helpers import Scoped

P = list(range(100, 132))  # a prefix everyone uses
SECRET = [7, 3, 9, 1, 4, 8]


def node_state(cache: Scoped) -> list[tuple[object, ...]]:
    """Everything about every node a probe could disturb."""
    return [
        (
            n.id,
            n.key,
            n.value.tobytes(),
            n.lock_ref,
            n.last_access_time,
            n.hit_count,
            n.visibility,
            tuple(sorted(n.holders)),
            n.owner,
            n.hits.epoch,
            dict(n.hits.current),
            dict(n.hits.previous),
            None if n.parent is None else n.parent.id,
            n.tombstone,
        )
        for n, _, _ in walk_scoped(cache.cache.root)
        if n is not cache.cache.root
    ]


# -- T1: a non-owner's probes --------------------------------------------------------------------


@pytest.mark.parametrize("promote_k", [None, 3])
def test_t1_a_non_owners_probes_match_nothing_and_change_nothing(promote_k: int | None) -> None:
    s = Scoped(promote_k=promote_k)
    s.serve(P + SECRET, "victim")
    before = node_state(s)
    probes = [P + SECRET, P + SECRET[:3], P[:5], P + SECRET[:5] + [0], [P[0]], [*P, SECRET[0], 0]]
    for probe in probes:
        assert s.probe(probe, "attacker") == 0
    assert node_state(s) == before  # no split, counter, LRU stamp, lock or window moved
    assert s.probe(P + SECRET, "victim") == len(P + SECRET)  # control: the owner hits its own prompt
    assert s.probe(P + SECRET[:3], "victim") == len(P) + 3
    s.cache.check_integrity()


def test_t1_split_halves_copy_their_counters_and_never_share_them() -> None:
    s = Scoped(promote_k=3)
    s.serve(P + SECRET, "victim")
    (node,) = s.cache.root.copies()
    node.hits.add(0, "victim", 8)
    s.probe(P[:10], "victim")  # the owner's shorter match splits its node
    upper = next(iter(s.cache.root.copies()))
    (lower,) = upper.copies()
    assert upper.hits is not lower.hits and upper.hits.current is not lower.hits.current
    upper.hits.add(0, "victim", 8)
    assert lower.hits.current == {"victim": 1} and upper.hits.current == {"victim": 2}
    assert upper.holders == lower.holders == {"victim"}
    s.cache.check_integrity()


# -- epochs and promotion ----------------------------------------------------------------------


def test_window_rollover_keeps_one_previous_epoch_and_forgets_older_ones() -> None:
    w = Window()
    w.add(5, "a", 8)
    w.add(5, "b", 8)
    assert w.principals(5) == {"a", "b"} and w.principals(6) == {"a", "b"}  # previous bucket still counts
    assert w.principals(7) == set()  # idle two epochs: both buckets empty, not the stale current one
    w.add(6, "c", 8)
    assert (w.current, w.previous) == ({"c": 1}, {"a": 1, "b": 1})
    w.add(9, "d", 8)
    assert (w.current, w.previous) == ({"d": 1}, {})
    capped = Window()
    for name in "abcde":
        capped.add(0, name, 3)
    assert list(capped.current) == ["c", "d", "e"]


def test_promotion_needs_k_distinct_creators_in_the_window_and_an_epoch_boundary() -> None:
    s = Scoped(promote_k=3)
    for user in ("u1", "u2"):
        s.serve(P, user)
    s.tick_epoch()
    assert s.probe(P, "outsider") == 0  # two creators: not enough
    s.serve(P, "u3")
    assert s.probe(P, "outsider") == 0  # three now, but promotion waits for the epoch boundary
    s.tick_epoch()
    assert s.probe(P, "outsider") == len(P)  # control: promoted, everyone hits
    assert s.cache.stats().promotions == 1
    s.cache.check_integrity()


def test_repeats_by_one_principal_never_promote() -> None:
    s = Scoped(promote_k=2)
    for _ in range(5):
        s.serve(P, "u1")
        s.tick_epoch()
    assert s.probe(P, "outsider") == 0  # u1 computed P once (epoch 0); its repeats hit its own copy
    s.serve(P, "u2")
    s.serve(P, "u3")  # control: two creators in one window do it
    s.tick_epoch()
    assert s.probe(P, "outsider") == len(P)


def test_creators_older_than_the_window_do_not_count() -> None:
    s = Scoped(promote_k=2)
    s.serve(P, "u1")
    s.tick_epoch()
    s.tick_epoch()  # u1's creation is now two epochs old
    s.serve(P, "u2")
    s.tick_epoch()
    assert s.probe(P, "outsider") == 0
    s.serve(P, "u3")  # control: u2 (previous epoch) and u3 (this one) are both in the window
    s.tick_epoch()
    assert s.probe(P, "outsider") == len(P)


def test_promotion_cuts_at_the_longest_prefix_enough_principals_computed() -> None:
    s = Scoped(promote_k=2)
    s.serve([*P, 1, 2, 3], "u1")
    s.serve([*P, 5, 6], "u2")
    s.tick_epoch()
    assert s.probe([*P, 1, 2, 3], "outsider") == len(P)  # the shared part is public, the rest not
    assert s.probe([*P, 1, 2, 3], "u1") == len(P) + 3
    visibilities = {n.visibility for n, _, _ in walk_scoped(s.cache.root) if n is not s.cache.root}
    assert visibilities == {PUBLIC, PRIVATE}
    s.cache.check_integrity()


def test_promote_k_inf_is_per_principal_isolation() -> None:
    s = Scoped(promote_k=None)
    for i in range(6):
        s.serve(P, f"u{i}")
        s.tick_epoch()
    assert s.probe(P, "outsider") == 0
    assert all(s.probe(P, f"u{i}") == len(P) for i in range(6))  # control: each keeps its own copy
    assert s.cache.stats().promotions == 0
    s.cache.check_integrity()


def test_a_public_copy_already_there_blocks_a_second_promotion_without_breaking_anything() -> None:
    s = Scoped(promote_k=2)
    s.serve(P, "u1")
    s.serve(P, "u2")
    s.tick_epoch()
    s.probe(P, "u3")
    publics = [n for n in s.cache.root.copies() if n.visibility == PUBLIC]
    assert len(publics) == 1
    s.tick_epoch()
    assert len([n for n in s.cache.root.copies() if n.visibility == PUBLIC]) == 1
    s.cache.check_integrity()


# -- pinned prefixes ---------------------------------------------------------------------------


def test_pinned_prefixes_are_public_from_birth_and_nothing_past_them_is() -> None:
    s = Scoped(promote_k=None, pinned=[P])
    s.serve(P + SECRET, "victim")
    assert s.probe(P + SECRET, "attacker") == len(P)  # the pinned part hits for everyone
    assert s.probe(P + SECRET, "victim") == len(P + SECRET)
    kinds = sorted(n.visibility for n, _, _ in walk_scoped(s.cache.root) if n is not s.cache.root)
    assert kinds == [PINNED, PRIVATE]
    s.cache.check_integrity()


def test_a_pinned_prefix_under_a_private_node_stays_private() -> None:
    s = Scoped(promote_k=None, pinned=[P[4:]])  # only pinned from the root, not after a private start
    s.serve(P, "victim")
    assert s.probe(P, "attacker") == 0
    s.cache.check_integrity()


# -- dedup -------------------------------------------------------------------------------------


def test_dedup_on_joins_the_holders_and_saves_the_copy() -> None:
    deduped, copied = Scoped(promote_k=None, dedup=True), Scoped(promote_k=None, dedup=False)
    for s in (deduped, copied):
        s.serve(P, "u1")
        s.serve(P, "u2")
        assert s.probe(P, "u2") == len(P) and s.probe(P, "u1") == len(P)
        assert s.probe(P, "u3") == 0  # a third principal still sees nothing
        s.conserved()
    assert deduped.cache.total_size() == len(P) and copied.cache.total_size() == 2 * len(P)
    assert deduped.cache.stats().dedup_joins == 1


# -- demotion and tombstones -------------------------------------------------------------------


def test_the_monitor_demotes_a_public_node_probed_by_many_accounts() -> None:
    monitor = MonitorConfig(alpha=2.0, min_hits=4, min_new_users=4, min_user_ratio=0.0)
    s = Scoped(promote_k=2, monitor=monitor)
    s.serve(P, "u1")
    s.serve(P, "u2")
    s.tick_epoch()
    hits = [s.probe(P, f"probe{i}") for i in range(12)]
    assert hits[0] == len(P)  # control: public, it hit
    assert hits[-1] == 0  # the burst tripped the monitor: tombstoned, invisible to all
    assert s.cache.stats().demotions == 1
    s.conserved()  # unlocked: its pages went back at once
    s.cache.check_integrity()


def test_a_tombstoned_node_under_a_lock_frees_its_pages_when_the_lock_drops() -> None:
    s = Scoped(promote_k=2)
    s.serve(P, "u1")
    s.serve(P, "u2")
    s.tick_epoch()
    match = s.cache.match_prefix(np.asarray(P, dtype=np.int32), "u3")
    s.cache.inc_lock_ref(match.last_node)
    freed_before = s.allocator.available_size()
    tokens = s.cache.demote(match.last_node, ["u3"])
    assert tokens == len(P) and s.allocator.available_size() == freed_before  # locked: not freed yet
    assert s.probe(P, "u3") == 0 and s.probe(P, "u1") == 0  # invisible at once, to everyone
    assert s.probe(P, "u2") == len(P)  # control: u2's own private copy was never public, and stays
    s.cache.check_integrity()
    s.cache.dec_lock_ref(match.last_node)
    assert s.allocator.available_size() == freed_before + len(P)
    s.cache.check_integrity()


def test_events_name_the_principals_of_promote_demote_and_cross_hits(recording_cache: Scoped) -> None:
    s = recording_cache
    s.serve(P, "u1")
    s.serve(P, "u2")
    s.tick_epoch()
    s.serve(P, "u3")
    top = next(n for n in s.cache.root.copies() if n.visibility == PUBLIC)
    s.cache.demote(top, ["u3"])
    kinds = [(e["kind"], e.get("principal")) for e in s.cache.recorder.events]  # type: ignore[attr-defined]
    assert (EventKind.PROMOTE, "u1,u2") in kinds  # the creators that made it public
    assert (EventKind.CROSS_HIT, "u3") in kinds
    assert (EventKind.DEMOTE, "u3") in kinds
    assert (EventKind.CROSS_HIT, "u1") not in kinds  # control: its own node is no cross hit


@pytest.fixture
def recording_cache() -> Scoped:
    class Events:
        enabled = True

        def __init__(self) -> None:
            self.events: list[dict[str, object]] = []

        def record(self, kind: EventKind, **fields: object) -> None:
            self.events.append({"kind": kind, **fields})

    return Scoped(promote_k=2, recorder=Events())


# -- chain merging -----------------------------------------------------------------------------


def test_merging_a_private_multi_turn_chain_keeps_every_answer() -> None:
    merged, plain = Scoped(promote_k=None, merge_chains=True), Scoped(promote_k=None)
    turns = [P[: 8 * (i + 1)] for i in range(4)]
    for s in (merged, plain):
        for turn in turns:
            s.serve(turn, "u1")
        s.tick_epoch()
        s.probe([], "u1")
    chain = [n for n, _, _ in walk_scoped(merged.cache.root) if n is not merged.cache.root]
    assert len(chain) == 1 and merged.cache.stats().merges == 3
    assert len([n for n, _, _ in walk_scoped(plain.cache.root)]) == 5  # control: unmerged, one per turn
    for probe in [*turns, P[:5], P[:17], [*P, 1]]:
        for user in ("u1", "u2"):
            assert merged.probe(probe, user) == plain.probe(probe, user)
    merged.cache.check_integrity()
    plain.cache.check_integrity()


# -- bad arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options", [{"promote_k": 0}, {"epoch_s": 0}, {"epoch_s": float("inf")}, {"eviction_granularity": "node"}]
)
def test_impossible_options_are_one_clear_error(options: dict[str, object]) -> None:
    with pytest.raises(CacheMisuseError):
        Scoped(**options)


def test_nodes_are_scoped_nodes_with_copies_per_first_page() -> None:
    s = Scoped(promote_k=None)
    s.serve(P, "u1")
    s.serve(P, "u2")
    (copies,) = s.cache.root.children.values()
    assert len(copies) == 2 and all(isinstance(c, ScopedNode) for c in copies)
    assert sorted(c.owner or "" for c in copies) == ["u1", "u2"]
    clone = copy.copy(copies[0])
    assert clone.holders == {copies[0].owner}
    s.cache.check_integrity()
