"""CacheController: device -> host -> device copies keep every K/V byte, acknowledgements come
back in operation order and exactly once, and a copy that does not fit consumes nothing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvscope.mem import (
    BaseTokenAllocator,
    CacheController,
    HostKVPool,
    HostTokenAllocator,
    MHATokenToKVPool,
    make_token_allocator,
)

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 2, 4


@dataclass
class Tiers:
    device_alloc: BaseTokenAllocator
    device_kv: MHATokenToKVPool
    host_alloc: HostTokenAllocator
    host_kv: HostKVPool
    ctrl: CacheController

    def check_integrity(self, device_held: list[torch.Tensor], host_held: list[np.ndarray]) -> None:
        dev = torch.cat(device_held).cpu() if device_held else torch.empty(0, dtype=torch.int64)
        self.device_alloc.check_integrity(dev)
        host = np.concatenate(host_held) if host_held else np.empty(0, dtype=np.int64)
        self.host_alloc.check_integrity(host)


def make_tiers(
    page_size: int, device_tokens: int, host_tokens: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> Tiers:
    device_alloc = make_token_allocator(device_tokens, page_size, device, strict=True)
    assert isinstance(device_alloc, BaseTokenAllocator)
    device_kv = MHATokenToKVPool(device_tokens, page_size, dtype, NUM_HEADS, HEAD_DIM, NUM_LAYERS, device)
    host_alloc = HostTokenAllocator(host_tokens, page_size, strict=True)
    host_kv = HostKVPool.like(device_kv, host_tokens)
    return Tiers(
        device_alloc, device_kv, host_alloc, host_kv, CacheController(device_alloc, device_kv, host_alloc, host_kv)
    )


def fill_random(tiers: Tiers, slots: torch.Tensor, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random K/V for `slots` in every layer; returns what was written (as read back)."""
    gen = torch.Generator().manual_seed(seed)
    written = []
    for layer in range(NUM_LAYERS):
        k, v = (torch.randn(len(slots), NUM_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
        tiers.device_kv.set_kv_buffer(layer, slots, k.to(tiers.device_kv.device), v.to(tiers.device_kv.device))
        dev_k, dev_v = tiers.device_kv.get_kv_buffer(layer)
        written.append((dev_k[slots].cpu().clone(), dev_v[slots].cpu().clone()))
    return written


def fill_garbage(tiers: Tiers) -> None:
    for buf in (*tiers.device_kv.k_buffer, *tiers.device_kv.v_buffer):
        buf.fill_(0xA5 if buf.dtype == torch.uint8 else -7)


def assert_rows_equal(tiers: Tiers, slots: torch.Tensor, expected: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for layer, (k, v) in enumerate(expected):
        dev_k, dev_v = tiers.device_kv.get_kv_buffer(layer)
        got_k, got_v = dev_k[slots].cpu(), dev_v[slots].cpu()
        assert torch.equal(got_k.view(torch.uint8), k.view(torch.uint8)), f"layer {layer} K differs"
        assert torch.equal(got_v.view(torch.uint8), v.view(torch.uint8)), f"layer {layer} V differs"


def round_trip(tiers: Tiers, num_tokens: int) -> None:
    """Write random K/V to host, free and trash the device rows, load into new device slots."""
    start = (tiers.device_alloc.available_size(), tiers.host_alloc.available_size())
    slots = tiers.device_alloc.alloc(num_tokens)
    assert slots is not None
    expected = fill_random(tiers, slots, seed=num_tokens)
    host_slots = tiers.ctrl.write(slots, op_id=11)
    assert host_slots is not None and len(host_slots) == num_tokens
    assert tiers.ctrl.pending_writes() == 1
    tiers.ctrl.wait_all()
    assert tiers.ctrl.writing_check() == [11]
    assert tiers.ctrl.pending_writes() == 0
    tiers.check_integrity([slots], [host_slots])
    for layer, (k, v) in enumerate(expected):  # the host rows hold the device bytes
        host_k, host_v = tiers.host_kv.get_kv_buffer(layer)
        assert torch.equal(host_k[torch.from_numpy(host_slots)].view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(host_v[torch.from_numpy(host_slots)].view(torch.uint8), v.view(torch.uint8))

    tiers.device_alloc.free(slots)
    squatter = tiers.device_alloc.alloc(num_tokens)  # takes the freed pages if they come back first
    assert squatter is not None
    fill_garbage(tiers)
    loaded = tiers.ctrl.load(host_slots, op_id=12)
    assert loaded is not None and len(loaded) == num_tokens
    assert not set(loaded.tolist()) & set(slots.tolist()), "load reused the freed slots: test proves nothing"
    tiers.ctrl.wait_all()
    assert tiers.ctrl.loading_check() == [12]
    assert tiers.ctrl.loading_check() == []
    assert_rows_equal(tiers, loaded, expected)
    tiers.check_integrity([squatter, loaded], [host_slots])

    tiers.device_alloc.free(squatter)
    tiers.device_alloc.free(loaded)
    tiers.host_alloc.free(host_slots)
    tiers.check_integrity([], [])
    assert (tiers.device_alloc.available_size(), tiers.host_alloc.available_size()) == start


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_write_then_load_round_trips_every_byte(page_size: int, dtype: torch.dtype) -> None:
    tiers = make_tiers(page_size, device_tokens=64, host_tokens=32, dtype=dtype)
    round_trip(tiers, 3 * page_size)
    round_trip(tiers, 8)  # again, on slots that have been through the free lists


@pytest.mark.parametrize("page_size", [1, 4])
def test_acks_come_back_in_operation_order_exactly_once(page_size: int) -> None:
    tiers = make_tiers(page_size, device_tokens=64, host_tokens=64)
    held = [tiers.device_alloc.alloc(page_size) for _ in range(3)]
    host_held = []
    for op_id, slots in zip((5, 3, 9), held, strict=True):
        assert slots is not None
        host_slots = tiers.ctrl.write(slots, op_id)
        assert host_slots is not None
        host_held.append(host_slots)
    loads = [tiers.ctrl.load(host_held[0], 100), tiers.ctrl.load(host_held[2], 7)]
    assert tiers.ctrl.pending_writes() == 3 and tiers.ctrl.pending_loads() == 2
    assert tiers.ctrl.writing_check() == [5, 3, 9]
    assert tiers.ctrl.writing_check() == []
    assert tiers.ctrl.pending_loads() == 2  # write acks leave the load queue alone
    assert tiers.ctrl.loading_check() == [100, 7]
    assert tiers.ctrl.loading_check() == []
    assert tiers.ctrl.pending_writes() == 0 and tiers.ctrl.pending_loads() == 0
    device_held = [s for s in (*held, *loads) if s is not None]
    assert len(device_held) == 5
    tiers.check_integrity(device_held, host_held)


@pytest.mark.parametrize("page_size", [1, 4])
def test_load_returns_none_when_the_device_is_full_and_leaks_nothing(page_size: int) -> None:
    tiers = make_tiers(page_size, device_tokens=16, host_tokens=32)
    slots = tiers.device_alloc.alloc(2 * page_size)
    assert slots is not None
    fill_random(tiers, slots, seed=1)
    host_slots = tiers.ctrl.write(slots, op_id=1)
    assert host_slots is not None
    assert tiers.ctrl.writing_check() == [1]
    rest = tiers.device_alloc.alloc(tiers.device_alloc.available_size())
    assert rest is not None
    before = (tiers.device_alloc.available_size(), tiers.host_alloc.available_size())
    assert tiers.ctrl.load(host_slots, op_id=2) is None
    assert (tiers.device_alloc.available_size(), tiers.host_alloc.available_size()) == before
    assert tiers.ctrl.pending_loads() == 0 and tiers.ctrl.loading_check() == []
    tiers.check_integrity([slots, rest], [host_slots])

    tiers.device_alloc.free(slots)  # the caller evicts, then retries
    loaded = tiers.ctrl.load(host_slots, op_id=3)
    assert loaded is not None and tiers.ctrl.loading_check() == [3]
    for held in (loaded, rest):
        tiers.device_alloc.free(held)
    tiers.host_alloc.free(host_slots)
    tiers.check_integrity([], [])
    assert tiers.device_alloc.available_size() == 16 and tiers.host_alloc.available_size() == 32


@pytest.mark.parametrize("page_size", [1, 4])
def test_write_returns_none_when_the_host_is_full_and_leaks_nothing(page_size: int) -> None:
    tiers = make_tiers(page_size, device_tokens=32, host_tokens=4 * page_size)
    slots = tiers.device_alloc.alloc(2 * page_size)
    assert slots is not None
    first = tiers.ctrl.write(slots, op_id=1)
    assert first is not None
    before = (tiers.device_alloc.available_size(), tiers.host_alloc.available_size())
    more = tiers.device_alloc.alloc(3 * page_size)
    assert more is not None
    assert tiers.ctrl.write(more, op_id=2) is None  # 2 pages free on the host, 3 asked
    assert tiers.ctrl.pending_writes() == 1 and tiers.ctrl.writing_check() == [1]
    tiers.device_alloc.free(more)
    assert (tiers.device_alloc.available_size(), tiers.host_alloc.available_size()) == before
    tiers.check_integrity([slots], [first])
    tiers.device_alloc.free(slots)
    tiers.host_alloc.free(first)
    tiers.check_integrity([], [])
    assert tiers.device_alloc.available_size() == 32 and tiers.host_alloc.available_size() == 4 * page_size


def test_mismatched_tiers_are_refused() -> None:
    device_alloc = make_token_allocator(16, 4, "cpu")
    assert isinstance(device_alloc, BaseTokenAllocator)
    device_kv = MHATokenToKVPool(16, 4, torch.float32, NUM_HEADS, HEAD_DIM, NUM_LAYERS, "cpu")
    wrong_heads = HostKVPool(NUM_LAYERS, NUM_HEADS + 1, HEAD_DIM, torch.float32, 16)
    with pytest.raises(ValueError, match=r"host pool \(layers, heads"):
        CacheController(device_alloc, device_kv, HostTokenAllocator(16, 4), wrong_heads)
    with pytest.raises(ValueError, match="host page_size 1 != device page_size 4"):
        CacheController(device_alloc, device_kv, HostTokenAllocator(16, 1), HostKVPool.like(device_kv, 16))


class ControllerMachine(RuleBasedStateMachine):
    """Writes, loads, acks and frees in any order against a model: each held chunk (device or
    host) with the K/V it must hold, and the op ids not yet acknowledged, in issue order.
    Every step checks both allocators' conservation with the held slots; every acknowledged
    chunk's rows equal its model bytes."""

    page_size = 1
    device = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.tiers = make_tiers(
            self.page_size, device_tokens=8 * self.page_size, host_tokens=6 * self.page_size, device=self.device
        )
        self.device_chunks: list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self.host_chunks: list[tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self.unacked_writes: list[int] = []
        self.unacked_loads: list[int] = []
        self.next_op = 0

    @rule(num_pages=st.integers(1, 3))
    def prefill(self, num_pages: int) -> None:
        slots = self.tiers.device_alloc.alloc(num_pages * self.page_size)
        if slots is not None:
            self.device_chunks.append((slots, fill_random(self.tiers, slots, seed=self.next_op)))
            self.next_op += 1

    @precondition(lambda self: self.device_chunks)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        slots, expected = data.draw(st.sampled_from(self.device_chunks), "chunk")
        before = self.tiers.host_alloc.available_size()
        host_slots = self.tiers.ctrl.write(slots, self.next_op)
        if host_slots is None:
            assert before < len(slots) and self.tiers.host_alloc.available_size() == before
            return
        self.host_chunks.append((host_slots, expected))
        self.unacked_writes.append(self.next_op)
        self.next_op += 1

    @precondition(lambda self: self.host_chunks)
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        host_slots, expected = data.draw(st.sampled_from(self.host_chunks), "chunk")
        before = self.tiers.device_alloc.available_size()
        slots = self.tiers.ctrl.load(host_slots, self.next_op)
        if slots is None:
            assert before < len(host_slots) and self.tiers.device_alloc.available_size() == before
            return
        self.device_chunks.append((slots, expected))
        self.unacked_loads.append(self.next_op)
        self.next_op += 1

    @rule()
    def ack(self) -> None:
        assert self.tiers.ctrl.writing_check() == self.unacked_writes
        assert self.tiers.ctrl.loading_check() == self.unacked_loads
        self.unacked_writes, self.unacked_loads = [], []

    @precondition(lambda self: self.device_chunks)
    @rule(data=st.data())
    def free_device(self, data: st.DataObject) -> None:
        """Free a chunk and trash its rows, as the next owner would (after its copies finished:
        the cache keeps a chunk locked until then)."""
        slots, _ = self.device_chunks.pop(data.draw(st.integers(0, len(self.device_chunks) - 1), "index"))
        self.tiers.ctrl.wait_all()
        self.tiers.device_alloc.free(slots)
        for buf in (*self.tiers.device_kv.k_buffer, *self.tiers.device_kv.v_buffer):
            buf[slots] = 0xA5 if buf.dtype == torch.uint8 else -7

    @precondition(lambda self: self.host_chunks)
    @rule(data=st.data())
    def free_host(self, data: st.DataObject) -> None:
        host_slots, _ = self.host_chunks.pop(data.draw(st.integers(0, len(self.host_chunks) - 1), "index"))
        self.tiers.host_alloc.free(host_slots)

    @invariant()
    def conserved_and_intact(self) -> None:
        self.tiers.check_integrity([s for s, _ in self.device_chunks], [h for h, _ in self.host_chunks])
        assert self.tiers.ctrl.pending_writes() == len(self.unacked_writes)
        assert self.tiers.ctrl.pending_loads() == len(self.unacked_loads)
        self.tiers.ctrl.wait_loads_on_current_stream()
        for slots, expected in self.device_chunks:
            assert_rows_equal(self.tiers, slots, expected)


for _ps, _device in ((1, "cpu"), (4, "cpu"), (1, "cuda"), (4, "cuda")):
    _case = type(f"Controller_ps{_ps}_{_device}", (ControllerMachine,), {"page_size": _ps, "device": _device}).TestCase
    _case.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
    if _device == "cuda":
        _case.pytestmark = [pytest.mark.cuda]
    globals()[f"Test{_case.__qualname__.split('.')[0]}"] = _case
del _case


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 4])
def test_side_stream_copies_round_trip_and_ack_in_order(page_size: int) -> None:
    """On CUDA: copies run on the controller's stream, acks follow event completion, and the
    forward's stream sees loaded rows after wait_loads_on_current_stream()."""
    tiers = make_tiers(page_size, device_tokens=256, host_tokens=256, device="cuda", dtype=torch.bfloat16)
    assert tiers.ctrl.stream is not None and tiers.host_kv.pinned
    round_trip(tiers, 8 * page_size)

    slots = tiers.device_alloc.alloc(16 * page_size)
    assert slots is not None
    expected = fill_random(tiers, slots, seed=3)
    host_slots = [tiers.ctrl.write(slots[i::2], op_id=i) for i in range(2)]
    assert all(h is not None for h in host_slots)
    torch.cuda.synchronize()
    assert tiers.ctrl.writing_check() == [0, 1]
    tiers.device_alloc.free(slots)
    fill_garbage(tiers)
    loaded = []
    for i, h in enumerate(host_slots):
        assert h is not None
        got = tiers.ctrl.load(h, op_id=10 + i)
        assert got is not None
        loaded.append(got)
    tiers.ctrl.wait_loads_on_current_stream()
    for i, got in enumerate(loaded):  # read on the current stream, ordered after the loads
        assert_rows_equal(tiers, got, [(k[i::2], v[i::2]) for k, v in expected])
    tiers.ctrl.wait_all()
    assert tiers.ctrl.loading_check() == [10, 11]
    for got in loaded:
        tiers.device_alloc.free(got)
    for h in host_slots:
        tiers.host_alloc.free(h)
    tiers.check_integrity([], [])
    assert tiers.device_alloc.available_size() == 256 and tiers.host_alloc.available_size() == 256
