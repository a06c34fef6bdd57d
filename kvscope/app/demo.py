"""`kvscope demo`: a short live demo of the pools. Requests prefill, decode, finish; the slot
map is printed after each step so a newcomer sees who holds which page."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvscope.mem import (
    MHATokenToKVPool,
    PagedTokenToKVPoolAllocator,
    PoolMisuseError,
    ReqToTokenPool,
    SWATokenToKVPoolAllocator,
    resolve_device,
)


@dataclass
class DemoRequest:
    label: str
    prompt_len: int
    seq_len: int = 0
    req_pool_idx: int | None = None
    slots: list[int] = field(default_factory=list)


class PoolDemo:
    def __init__(self, device: torch.device, page_size: int, out: Callable[[str], None]) -> None:
        self.page_size = page_size
        self.out = out
        self.rows = ReqToTokenPool(num_rows=4, max_context_len=64, device=device)
        self.allocator = PagedTokenToKVPoolAllocator(64, page_size, device, strict=True)
        self.kv = MHATokenToKVPool(64, page_size, torch.float16, 2, 8, 2, device)
        self.requests: list[DemoRequest] = []

    def slot_map(self) -> str:
        owner = {s // self.page_size: r.label for r in self.requests for s in r.slots}
        free = set(self.allocator.free_pages.tolist())
        cells = [
            "#" if p == 0 else "." if p in free else owner.get(p, "?") for p in range(self.allocator.num_pages + 1)
        ]
        return "".join(cells)

    def show(self, what: str) -> None:
        owned = [s for r in self.requests for s in r.slots]
        self.allocator.check_integrity(owned)
        self.rows.check_integrity([r.req_pool_idx for r in self.requests if r.req_pool_idx])
        used = self.allocator.usage()
        self.out(
            f"{what:<34} pages |{self.slot_map()}|  available {used.available_size:>2} / "
            f"{used.total_size} tokens, rows free {self.rows.available_size()}"
        )

    def prefill(self, reqs: list[DemoRequest]) -> None:
        self.rows.alloc(reqs)
        slots = self.allocator.alloc_extend(
            [0] * len(reqs), [r.prompt_len for r in reqs], [-1] * len(reqs), sum(r.prompt_len for r in reqs)
        )
        assert slots is not None
        start = 0
        for r in reqs:
            r.slots = slots[start : start + r.prompt_len].tolist()
            r.seq_len = r.prompt_len
            start += r.prompt_len
            assert r.req_pool_idx is not None
            self.rows.write(r.req_pool_idx, 0, torch.tensor(r.slots))
        self.write_kv(slots)
        self.requests.extend(reqs)
        self.show("prefill " + ", ".join(f"{r.label}({r.prompt_len})" for r in reqs))

    def decode(self) -> None:
        live = [r for r in self.requests if r.req_pool_idx is not None]
        slots = self.allocator.alloc_decode([r.seq_len + 1 for r in live], [r.slots[-1] for r in live])
        assert slots is not None
        for r, slot in zip(live, slots.tolist(), strict=True):
            assert r.req_pool_idx is not None
            self.rows.write(r.req_pool_idx, r.seq_len, torch.tensor([slot]))
            r.slots.append(slot)
            r.seq_len += 1
        self.write_kv(slots)
        self.show(f"decode (seq_lens {[r.seq_len for r in live]})")

    def finish(self, req: DemoRequest) -> None:
        self.allocator.free_group_begin()
        self.allocator.free(torch.tensor(req.slots, device=self.allocator.device))
        self.allocator.free_group_end()
        self.rows.free(req)
        self.requests.remove(req)
        self.show(f"finish {req.label} (pages back, LIFO)")
        self.finished = req

    def write_kv(self, slots: torch.Tensor) -> None:
        k = torch.randn(len(slots), 2, 8, device=slots.device)
        for layer in range(self.kv.num_layers):
            self.kv.set_kv_buffer(layer, slots, k, -k)

    def misuse(self) -> None:
        try:
            self.allocator.free(torch.tensor(self.finished.slots[:2], device=self.allocator.device))
        except PoolMisuseError as err:
            self.out(f"free {self.finished.label} again: strict mode -> {err}")
        else:
            raise AssertionError("strict mode missed a double free")


def swa_demo(device: torch.device, out: Callable[[str], None]) -> None:
    swa = SWATokenToKVPoolAllocator(32, 16, 1, device)
    full = swa.alloc(12)
    assert full is not None
    out(f"SWA: 12 tokens -> full slots {full.tolist()}")
    out(f"     paired SWA slots {swa.translate_loc(full).tolist()}")
    swa.free_swa(full[:8])
    out(f"     8 tokens leave the window: SWA slots {swa.translate_loc(full).tolist()}")
    out(f"     full available {swa.full_available_size()}/32, SWA available {swa.swa_available_size()}/16")
    swa.check_integrity(full)


def demo_verb(args: argparse.Namespace) -> int:
    run_demo(args.device, args.page_size, args.delay)
    return 0


def run_demo(
    device_name: str | None = None, page_size: int = 4, delay_s: float = 0.3, out: Callable[[str], None] = print
) -> None:
    device = resolve_device(device_name)
    demo = PoolDemo(device, page_size, out)
    out(f"kvscope pool demo on {device} (page size {page_size}; '#' padding page, '.' free, letter = owner)")
    steps: list[Callable[[], None]] = [
        lambda: demo.show("start"),
        lambda: demo.prefill([DemoRequest("A", 9), DemoRequest("B", 5)]),
        demo.decode,
        demo.decode,
        demo.decode,
        lambda: demo.prefill([DemoRequest("C", 13)]),
        lambda: demo.finish(demo.requests[0]),
        demo.misuse,
        demo.decode,
        lambda: demo.prefill([DemoRequest("D", 6)]),
        lambda: swa_demo(device, out),
    ]
    for step in steps:
        step()
        time.sleep(delay_s)
    out(f"KV buffers: {demo.kv.bytes_used()} bytes on {device} ({demo.kv.bytes_per_token} bytes per token)")
