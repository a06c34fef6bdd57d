"""The SGLang probe's ledger, folded in bulk: allocator calls and binds are queued as they happen
(index tensors, no read per call) and folded later, many at once; the census's culprits must come
out as if each call had been applied in order. Real torch tensors stand for SGLang's index
tensors (the engine test runs the same code on SGLang's real allocators)."""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvscope.probe import sglang_hooks
from kvscope.probe.sglang_ledger import ALLOC, BIND, FREE, Ledger, PageLedger, fold_pages
from kvscope.telemetry.remote import block_as_items

PAGE_SIZE = 4


def queue(ledger: PageLedger, entries: list[tuple[object, ...]]) -> None:
    """Entries onto the ledger's queue as the probe's hooks put them there: each one's values, flat."""
    for entry in entries:
        ledger.pending.extend(entry)


def slots_of(*pages: int) -> torch.Tensor:
    """The token slots of whole pages, as SGLang's paged alloc returns them."""
    return torch.tensor([p * PAGE_SIZE + i for p in pages for i in range(PAGE_SIZE)], dtype=torch.int64)


def test_the_ledger_keeps_each_pages_last_writer_in_call_order() -> None:
    ledger = Ledger()
    entries = [("req-A", 1, "alloc"), ("req-B", 2, "alloc"), ("req-C", 3, "decode")]
    ledger.write(np.array([5, 6, 5, 9, 6]), np.array([0, 0, 1, 1, 2]), *zip(*entries, strict=True))
    assert (ledger[5], ledger[6], ledger[9]) == (entries[1], entries[2], entries[1])
    assert 7 not in ledger and 500 not in ledger and sorted(ledger) == [5, 6, 9]
    ledger.write(np.array([9]), np.array([0]), ["req-D"], [4], ["alloc"])
    ledger.compact()  # NOTE: the entries no page names any more are dropped; the answers stay
    assert (ledger[5], ledger[6], ledger[9]) == (entries[1], entries[2], ("req-D", 4, "alloc"))
    assert len(ledger.rids) == len(ledger.steps) == len(ledger.events) == 3


def test_a_fold_gives_each_calls_distinct_pages_and_drops_the_padding_slot() -> None:
    values = np.array([21, 20, 22, 23, 8, 9, 0, 0, 13, 12], np.int64)  # call 0: page 5; call 1: pages 2, (0), 3
    pages, segs = fold_pages(values, np.array([4, 6]), PAGE_SIZE, dedup=True)
    assert (pages.tolist(), segs.tolist()) == ([5, 2, 3], [0, 1, 1])
    values = np.array([12, 13, 8, 9, 12, 4], np.int64)  # call 0: pages 3, 2, 3 (not in order); call 1: page 1
    pages, segs = fold_pages(values, np.array([5, 1]), PAGE_SIZE, dedup=True)
    assert (pages.tolist(), segs.tolist()) == ([2, 3, 1], [0, 0, 1])
    freed, segs = fold_pages(np.array([7, 3, 7]), np.array([2, 1]), PAGE_SIZE, dedup=False)
    assert (freed.tolist(), segs.tolist()) == ([7, 3, 7], [0, 0, 1])  # NOTE: page ids as freed, repeats kept


def test_calls_and_binds_folded_together_name_the_last_taker_and_releaser() -> None:
    """Page 3 is taken by a batch alloc (no request), bound to req-B's row, freed by req-B's release,
    then taken again by req-C: one fold of all four must name req-C, as four folds would."""
    ledger = PageLedger()
    allocator = SimpleNamespace(page_size=PAGE_SIZE)
    queue(
        ledger,
        [
            (ALLOC, allocator, None, 1, "alloc", slots_of(3, 4), None),
            (BIND, allocator, ["req-B", "req-E"], 1, "extend", slots_of(3, 4), [4, 4]),
            (FREE, allocator, "req-B", 2, "release", torch.tensor([3]), None),
            (ALLOC, allocator, "req-C", 3, "alloc", slots_of(3), None),
        ],
    )
    ledger.drain(3, None)
    takers, releasers = ledger.takers["full"], ledger.releasers["full"]
    assert (takers[3], takers[4]) == (("req-C", 3, "alloc"), ("req-E", 1, "extend"))
    assert dict(releasers) == {3: ("req-B", 2, "release")}
    assert not ledger.pending


def test_a_folds_event_block_reads_back_as_one_event_per_allocator_call_in_call_order() -> None:
    """Allocs and frees of two allocators (full, swa) interleaved with a bind: the fold's one event
    block reads back (the recorder host's block_as_items) as the per-call events the probe emitted
    one by one before the block: call order, the call's distinct pages, pages x page size tokens,
    its step's clock read, and no event for the bind."""
    ledger = PageLedger()
    full, swa = SimpleNamespace(page_size=PAGE_SIZE), SimpleNamespace(page_size=2)
    ledger.pools[id(swa)] = "swa"
    ledger.step_now = {1: 10.5}
    queue(
        ledger,
        [
            (ALLOC, full, "req-A", 1, "alloc", slots_of(3, 4), None),
            (ALLOC, swa, "req-A", 1, "alloc", torch.tensor([6, 7, 8, 9]), None),
            (BIND, full, ["req-A"], 1, "extend", slots_of(3, 4), [8]),
            (FREE, full, "req-B", 2, "release", torch.tensor([7, 2]), None),
            (ALLOC, full, None, 2, "alloc", torch.tensor([0, 0, 21, 20]), None),  # NOTE: the padding slot dropped
            (FREE, swa, "req-B", 2, "release", torch.tensor([4]), None),
            (FREE, full, "req-C", 2, "release", torch.tensor([], dtype=torch.int64), None),
        ],
    )
    blocks: list[tuple[object, ...]] = []
    now = ledger.drain(2, blocks.append)
    assert now is not None and len(blocks) == 1
    items = block_as_items(blocks[0])
    events = [items[i : i + 11] for i in range(0, len(items), 11)]
    expected = [
        (1, 10.5, "alloc", "full", "req-A", 8, [3, 4]),
        (1, 10.5, "alloc", "swa", "req-A", 4, [3, 4]),
        (2, now, "free", "full", "req-B", 8, [7, 2]),
        (2, now, "alloc", "full", None, 4, [5]),
        (2, now, "free", "swa", "req-B", 2, [4]),
        (2, now, "free", "full", "req-C", 0, []),
    ]
    assert [(e[0], e[1], e[2], e[3], e[4], e[6], e[10].tolist()) for e in events] == expected
    assert all(e[5] is None and e[7] == 0 and e[8] is None and e[9] is None for e in events)
    assert ledger.takers["full"][3] == ("req-A", 1, "extend") and ledger.releasers["swa"][4] == ("req-B", 2, "release")


class SlotFreeList:
    """SGLang 0.5.23's MambaSlotAllocator free list, as its mem_cache/allocator/mamba.py keeps it:
    alloc slices the head of free_slots (or, in a group, hands out a pre-taken batch one slot at a
    time), free makes a new free_slots (cat of the old one and the index), clear starts over. The
    engine test runs the probe on SGLang's own class; this one lets hypothesis drive every order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.batch: list[torch.Tensor] | None = None
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)

    def take(self, need: int) -> torch.Tensor | None:
        if need > len(self.free_slots):
            return None
        out = self.free_slots[:need]
        self.free_slots = self.free_slots[need:]
        return out

    def alloc(self, need: int) -> torch.Tensor | None:
        if self.batch and need == 1:
            return self.batch.pop(0)
        return self.take(need)

    def free(self, index: torch.Tensor) -> None:
        if index.numel():
            self.free_slots = torch.cat((self.free_slots, index))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("aafffgcdbx"), st.integers(0, 4), st.sampled_from((0, 0, 0, 1))), max_size=60),
    st.integers(2, 12),
)
@example([("a", 1, 0), ("f", 1, 0), ("d", 0, 0), ("a", 1, 0), ("a", 1, 0)], 2)  # NOTE: a chain across a fold
@example([("a", 0, 0), ("a", 0, 0), ("f", 0, 0), ("f", 0, 1), ("f", 1, 0), ("a", 0, 0)], 2)  # NOTE: equal chains
def test_mamba_calls_folded_in_bulk_name_the_slots_each_call_took_or_gave_back(
    ops: list[tuple[str, int, int]], size: int
) -> None:
    """Random allocs, frees (of a view rewritten right after the call, as SGLang frees a request's
    ping-pong slot; k = 0: a free of nothing), groups, clears and folds (d: on this thread, b: on the
    ledger's worker, while the calls go on) on two Mamba free lists (an
    active pool and, now and then, a second one: an int8 checkpoint pool's), through the probe's own
    alloc and free hooks: each call's event names exactly the slots it took or gave back, in call
    order, and each pool's ledgers name each slot's last taker and releaser, as if every call had been
    folded on its own. Breaking the hooks' run logic (a run kept past what its free_slots holds, a
    chain not ended at a clear, a pop's place), the fold's (run_tails, chain_takes) or a chain going
    on across folds fails it."""
    probe = sglang_hooks.SglangProbe(None, "test")
    probe.state.active, probe.hot = True, True
    alloc, free = sglang_hooks._d_mamba_alloc(SlotFreeList.alloc), sglang_hooks._d_mamba_free(SlotFreeList.free)
    pools = (SlotFreeList(size), SlotFreeList(3))
    ledger = probe.ledger
    held: tuple[list[int], list[int]] = ([], [])
    expected: list[tuple[str, str | None, list[int]]] = []  # NOTE: (kind, rid, slots) per recorded call
    takers: tuple[dict[int, str | None], ...] = ({}, {})
    releasers: tuple[dict[int, str | None], ...] = ({}, {})
    got: list[tuple[str, str | None, list[int]]] = []

    def fold() -> None:
        blocks: list[tuple[object, ...]] = []
        ledger.drain(0, blocks.append)
        for block in blocks:
            items = block_as_items(block)
            got.extend((items[i + 2], items[i + 4], items[i + 10].tolist()) for i in range(0, len(items), 11))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sglang_hooks, "PROBE", probe)  # NOTE: the hooks read their module's PROBE
        for n, (op, k, p) in enumerate(ops):
            probe.rid = rid = f"req-{n}"
            pool = pools[p]
            if op == "a":
                out = alloc(pool, k or 1)
                if out is not None:
                    expected.append(("alloc", rid, out.tolist()))
                    held[p].extend(out.tolist())
                    takers[p].update(dict.fromkeys(out.tolist(), rid))
            elif op == "f":
                give = held[p][:k]
                del held[p][: len(give)]
                buffer = torch.tensor([-1, *give], dtype=torch.int64)
                free(pool, buffer[1:])
                buffer.fill_(-1)  # NOTE: SGLang's set_mamba_ping_pong_slot(req, idx, -1) right after
                expected.append(("free", rid, give))
                releasers[p].update(dict.fromkeys(give, rid))
            elif op == "g":
                pool.batch = None
                batch = pool.take(k)
                pool.batch = None if batch is None else list(batch.split(1))
            elif op == "c" and pool.batch:  # NOTE: SGLang's alloc_group_end: the unused slots back through free
                rest = torch.cat(pool.batch)
                pool.batch = None
                probe.rid = None
                free(pool, rest)
                expected.append(("free", None, rest.tolist()))
                releasers[p].update(dict.fromkeys(rest.tolist(), None))
            elif op == "d":
                fold()
            elif op == "b":
                ledger.fold_later(0, True)
            elif op == "x":  # NOTE: clear(): a new free_slots, not the last one's slice (a chain ends)
                pool.clear()
                pool.batch = None
                held[p].clear()
        fold()
    assert got == expected
    for p, pool in enumerate(pools):
        mine_taken, mine_freed = ledger.takers["mamba"].get(id(pool), {}), ledger.releasers["mamba"].get(id(pool), {})
        assert {s: e[0] for s, e in mine_taken.items()} == takers[p]
        assert {s: e[0] for s, e in mine_freed.items()} == releasers[p]
    assert not ledger.takers["full"] and not ledger.releasers["full"]
    assert all(run[2] == 0 for run in ledger.slot_runs)  # NOTE: at most the open run, going on, nothing in it yet


def _slots(pages: list[int], page_size: int, padding: int) -> torch.Tensor:
    """A take's token slots: the pages' slots page by page (in the pages' order), `padding` slot-0
    entries first (SGLang's padding slot, which the fold drops)."""
    return torch.tensor([0] * padding + [p * page_size + i for p in pages for i in range(page_size)], dtype=torch.int64)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("aafb"),
            st.lists(st.integers(1, 9), max_size=4),
            st.integers(0, 2),
            st.integers(1, 3),
        ),
        min_size=1,
        max_size=30,
    ),
    st.sampled_from((1, 2, 4)),
)
@example([("a", [3, 1], 0, 1), ("f", [1], 0, 1), ("a", [1, 3, 3], 1, 1)], 4)  # NOTE: a take not in page order
def test_one_fold_of_a_paged_allocators_mixed_calls_equals_folding_each_call_alone(
    ops: list[tuple[str, list[int], int, int]], page_size: int
) -> None:
    """Allocs (pages in any order, repeats, the padding slot), frees (page ids, repeats kept) and
    binds of one paged allocator, queued in random order: one fold of them all gives the same events,
    in call order, and the same takers and releasers as a fold after every call (the one-allocator
    fold, PageLedger.fold_mixed; breaking its dedup, its page order or its entry order fails this)."""
    allocator = SimpleNamespace(page_size=page_size)
    entries: list[tuple[object, ...]] = []
    for n, (op, pages, padding, many) in enumerate(ops):
        rid, step = f"req-{n}", n // 3
        if op == "a":
            entries.append((ALLOC, allocator, rid, step, "alloc", _slots(pages, page_size, padding), None))
        elif op == "f":
            entries.append((FREE, allocator, rid, step, "release", torch.tensor(pages, dtype=torch.int64), None))
        else:  # NOTE: a bind of `many` requests, each the same pages' slots
            slots = torch.cat([_slots(pages, page_size, padding)] * many)
            parts = [len(slots) // many] * many
            entries.append((BIND, allocator, [f"{rid}-{j}" for j in range(many)], step, "extend", slots, parts))

    def events(ledger: PageLedger, folds: list[list[tuple[object, ...]]]) -> list[tuple[object, ...]]:
        got: list[tuple[object, ...]] = []
        for batch in folds:
            queue(ledger, batch)
            blocks: list[tuple[object, ...]] = []
            ledger.drain(9, blocks.append)
            for block in blocks:
                items = block_as_items(block)
                got += [(items[i], items[i + 2], items[i + 4], items[i + 6], items[i + 10].tolist())
                        for i in range(0, len(items), 11)]  # fmt: skip
        return got

    once, each = PageLedger(), PageLedger()
    assert events(once, [entries]) == events(each, [[e] for e in entries])
    for name in ("takers", "releasers"):
        assert dict(getattr(once, name)["full"]) == dict(getattr(each, name)["full"])


def tuples_tracked() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is tuple)


def test_the_allocator_hooks_keep_no_object_per_call_beyond_the_calls_tensor() -> None:
    """Each queued call keeps only SGLang's index tensor alive for the cyclic GC: its who and when are
    plain values on the flat queue, not a tuple per call (kept tuples doubled the objects each of
    the GC's collections between folds scans and promotes). The fold reads
    them back: one event per call."""

    class Paged:
        page_size = PAGE_SIZE

        def alloc(self, need_size: int) -> torch.Tensor:
            return torch.arange(need_size, dtype=torch.int64) + PAGE_SIZE

    probe = sglang_hooks.SglangProbe(None, "test")
    probe.state.active, probe.hot = True, True
    alloc, pool, calls = sglang_hooks._d_alloc(Paged.alloc), Paged(), 300
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sglang_hooks, "PROBE", probe)  # NOTE: the hooks read their module's PROBE
        gc.collect()
        before = tuples_tracked()
        for _ in range(calls):
            alloc(pool, PAGE_SIZE)
        kept = tuples_tracked() - before  # NOTE: tuples only: objects an earlier test left (a fold worker's
        blocks: list[tuple[object, ...]] = []  # ledger ending) may be freed meanwhile and lower a total count
        probe.ledger.drain(0, blocks.append)
    assert kept <= 20
    assert len(block_as_items(blocks[0])) == 11 * calls and probe.ledger.takers["full"][1][0] is None


def _folded_calls(blocks: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """(kind, rid, step, pages) of each event in the blocks, in order."""
    got = []
    for block in blocks:
        items = block_as_items(block)
        got += [(items[i + 2], items[i + 4], items[i], items[i + 10].tolist()) for i in range(0, len(items), 11)]
    return got


def _wait_for(done: Callable[[], bool]) -> None:
    """Until done() (the worker's fold), at most 20 s."""
    deadline = time.monotonic() + 20
    while not done():
        assert time.monotonic() < deadline, "the ledger's worker did not fold within 20 s"
        time.sleep(0.001)


def test_a_background_fold_frees_sglangs_tensors_off_the_callers_thread_and_a_drain_then_is_exact() -> None:
    """fold_later takes the queue on the caller's (the engine's) thread and folds it on the ledger's
    worker, where the kept index tensors are let go; the next drain folds what was queued since on the
    caller's thread, and hands over both folds' events in call order, the ledgers naming the last
    writer as one inline fold would."""
    ledger = PageLedger()
    allocator = SimpleNamespace(page_size=PAGE_SIZE)
    freed_on: list[int] = []
    first = slots_of(3, 4)
    weakref.finalize(first, lambda: freed_on.append(threading.get_ident()))
    queue(ledger, [(ALLOC, allocator, "req-A", 1, "alloc", first, None)])
    del first
    assert ledger.fold_later(1, True) is not None and not ledger.pending
    _wait_for(lambda: len(ledger.blocks) == 1)
    assert freed_on and freed_on[0] != threading.get_ident()
    queue(ledger, [(FREE, allocator, "req-A", 2, "release", torch.tensor([3]), None)])
    queue(ledger, [(ALLOC, allocator, "req-B", 2, "alloc", slots_of(3), None)])
    blocks: list[tuple[object, ...]] = []
    ledger.drain(2, blocks.append)
    assert _folded_calls(blocks) == [
        ("alloc", "req-A", 1, [3, 4]),
        ("free", "req-A", 2, [3]),
        ("alloc", "req-B", 2, [3]),
    ]
    assert ledger.takers["full"][3] == ("req-B", 2, "alloc") and ledger.releasers["full"][3] == ("req-A", 2, "release")
    assert not ledger.batches and not ledger.blocks


def test_calls_queued_from_other_threads_while_batches_are_taken_are_never_lost() -> None:
    """Threads queue allocator calls as fast as they can while this one takes batch after batch for
    the worker (switching threads every microsecond): every call comes out of the folds exactly
    once, each thread's in its order (a take that copied the queue and then cleared it lost the
    calls queued in between)."""
    ledger = PageLedger()
    allocator = SimpleNamespace(page_size=1)
    num_threads, num_calls = 4, 20_000
    ones = [torch.tensor([1 + i]) for i in range(64)]

    def hammer(rid: str) -> None:
        extend = ledger.pending.extend
        for i in range(num_calls):
            extend((ALLOC, allocator, rid, i, "alloc", ones[i % 64], None))

    threads = [threading.Thread(target=hammer, args=(f"t{n}",)) for n in range(num_threads)]
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            ledger.fold_later(0, True)
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(was)
    blocks: list[tuple[object, ...]] = []
    ledger.drain(0, blocks.append)
    got = _folded_calls(blocks)
    assert len(got) == num_threads * num_calls
    for n in range(num_threads):
        assert [(step, pages) for _, rid, step, pages in got if rid == f"t{n}"] == [
            (i, [1 + i % 64]) for i in range(num_calls)
        ]


def test_a_failed_background_fold_is_raised_on_the_callers_thread_at_its_next_hand_over() -> None:
    """The worker never raises: a fold's error waits for the engine thread's next hand_over (the
    probe's step), which raises it where the probe's guard stops recording."""
    ledger = PageLedger()
    queue(ledger, [(ALLOC, SimpleNamespace(page_size=PAGE_SIZE), "req-A", 1, "alloc", "not a tensor", None)])
    ledger.fold_later(1, True)
    _wait_for(lambda: ledger.failure is not None)
    assert ledger.worker is not None and ledger.worker.is_alive()
    with pytest.raises(AttributeError):
        ledger.hand_over(None)
    ledger.hand_over(None)  # NOTE: raised once
    assert not ledger.batches


def test_a_ledgers_fold_worker_ends_once_the_ledger_is_gone() -> None:
    """The worker holds its ledger weakly: a ledger dropped (a test's, a probe made again) takes its
    thread with it instead of leaving one waiting for ever."""
    ledger = PageLedger()
    queue(ledger, [(ALLOC, SimpleNamespace(page_size=PAGE_SIZE), "req-A", 1, "alloc", slots_of(3), None)])
    ledger.fold_later(1, True)
    blocks = ledger.blocks
    _wait_for(lambda: len(blocks) == 1)
    worker = ledger.worker
    assert worker is not None and worker.is_alive()
    del ledger
    gc.collect()
    worker.join(timeout=20)
    assert not worker.is_alive()


class _Gated:
    """A paged allocator whose page size is read only once the test opens the gate: a fold of its
    calls on the worker stays in flight until then."""

    def __init__(self) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()

    @property
    def page_size(self) -> int:
        self.entered.set()
        self.gate.wait(20)
        return PAGE_SIZE


def test_a_drain_waits_for_the_workers_fold_in_flight_and_folds_after_it() -> None:
    """A census's drain while the worker is still folding an earlier batch waits for that fold, then
    folds what was queued since: the later call wins in the ledger and the events stay in call order."""
    ledger, gated, plain = PageLedger(), _Gated(), SimpleNamespace(page_size=PAGE_SIZE)
    queue(ledger, [(ALLOC, gated, "req-A", 1, "alloc", slots_of(3), None)])
    ledger.fold_later(1, True)
    assert gated.entered.wait(20)
    queue(ledger, [(ALLOC, plain, "req-B", 2, "alloc", slots_of(3), None)])
    blocks: list[tuple[object, ...]] = []
    census = threading.Thread(target=ledger.drain, args=(2, blocks.append))
    census.start()
    census.join(timeout=0.5)
    waited = census.is_alive()
    gated.gate.set()
    census.join(timeout=20)
    assert waited and not census.is_alive()
    assert [(rid, step) for _, rid, step, _ in _folded_calls(blocks)] == [("req-A", 1), ("req-B", 2)]
    assert ledger.takers["full"][3] == ("req-B", 2, "alloc")
