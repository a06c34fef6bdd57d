"""A hand-built memory system around the model: real pools, real allocators, NaN poison.

NOTE: every K/V buffer starts as NaN, and SWA slots freed by window freeing are poisoned
again, so a forward that gathers any slot its tokens did not write (padding slot 0, a
freed SWA slot, a slot never allocated) returns NaN logits. Requests are stand-ins
holding their tokens; `kv_len` tokens are in the pool, positions [0, swa_frontier_len)
have had their SWA half freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvscope.engine.model import ForwardBatch, ForwardMode, TinyTransformer, kv_pool_shape
from kvscope.mem import (
    BaseTokenAllocator,
    MHATokenToKVPool,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    SWAKVPool,
    SWATokenToKVPoolAllocator,
    free_swa_out_of_window,
    make_token_allocator,
)


@dataclass
class Seq:
    token_ids: list[int]
    req_pool_idx: int | None = None
    kv_len: int = 0
    swa_frontier_len: int = 0
    owned_slots: list[int] = field(default_factory=list)


class PoolHarness:
    def __init__(
        self,
        model: TinyTransformer,
        page_size: int,
        *,
        full_size: int = 1024,
        swa_size: int = 512,
        free_window: bool = True,
        num_rows: int = 8,
        max_context_len: int = 320,
    ) -> None:
        self.model = model
        self.config = model.config
        self.page_size = page_size
        self.free_window = free_window and self.config.is_hybrid
        device = model.device
        self.rows = ReqToTokenPool(num_rows, max_context_len, device, strict=True)
        shape = kv_pool_shape(self.config)

        def pool(size: int, num_layers: int, name: str) -> MHATokenToKVPool:
            return MHATokenToKVPool(
                size, page_size, shape.dtype, shape.num_kv_heads, shape.head_dim, num_layers, device, name=name
            )

        self.allocator: BaseTokenAllocator | SWATokenToKVPoolAllocator
        self.kv_pool: MHATokenToKVPool | SWAKVPool
        if shape.is_hybrid:
            self.allocator = SWATokenToKVPoolAllocator(full_size, swa_size, page_size, device, strict=True)
            self.kv_pool = SWAKVPool(
                pool(full_size, shape.num_full_layers, "full"),
                pool(swa_size, shape.num_swa_layers, "swa"),
                list(shape.swa_layer_ids),
                self.allocator.full_to_swa_index_mapping,
            )
        else:
            self.allocator = make_token_allocator(full_size, page_size, device, strict=True)
            self.kv_pool = pool(full_size, self.config.num_layers, "full")
        for buffer in self.buffers(swa_only=False):
            buffer.fill_(float("nan"))
        self.num_swa_slots_freed = 0
        self.seqs: list[Seq] = []  # every request that holds a row

    def buffers(self, *, swa_only: bool) -> list[torch.Tensor]:
        if isinstance(self.kv_pool, SWAKVPool):
            pools = [self.kv_pool.swa_kv_pool] if swa_only else [self.kv_pool.full_kv_pool, self.kv_pool.swa_kv_pool]
        else:
            pools = [] if swa_only else [self.kv_pool]
        return [b for p in pools for b in (*p.k_buffer, *p.v_buffer)]

    # -- one forward -----------------------------------------------------------------------

    def extend(self, seqs: list[Seq], extend_lens: list[int], *, all_logits: bool = False) -> torch.Tensor:
        return self._forward("extend", seqs, extend_lens, all_logits)

    def decode(self, seqs: list[Seq]) -> torch.Tensor:
        return self._forward("decode", seqs, [1] * len(seqs), False)

    def _forward(self, mode: ForwardMode, seqs: list[Seq], extend_lens: list[int], all_logits: bool) -> torch.Tensor:
        if self.free_window:
            for seq in seqs:
                self._free_out_of_window(seq)
        self._hold_rows(seqs)
        slots = self._alloc_slots(mode, seqs, extend_lens)
        input_ids: list[int] = []
        start = 0
        for seq, ext in zip(seqs, extend_lens, strict=True):
            mine = slots[start : start + ext]
            assert seq.req_pool_idx is not None
            self.rows.write(seq.req_pool_idx, seq.kv_len, mine)
            seq.owned_slots += mine.tolist()
            input_ids += seq.token_ids[seq.kv_len : seq.kv_len + ext]
            start += ext
        batch = ForwardBatch.build(
            mode,
            input_ids,
            [s.req_pool_idx for s in seqs if s.req_pool_idx is not None],
            [s.kv_len for s in seqs],
            slots,
            extend_lens,
        )
        logits = self.model(batch, self.rows, self.kv_pool, all_logits=all_logits)
        for seq, ext in zip(seqs, extend_lens, strict=True):
            seq.kv_len += ext
        self.check_integrity()
        return logits

    def _alloc_slots(self, mode: ForwardMode, seqs: list[Seq], extend_lens: list[int]) -> torch.Tensor:
        num_tokens = sum(extend_lens)
        allocator = self.allocator
        if self.page_size == 1:
            slots = allocator.alloc(num_tokens)
        else:
            assert isinstance(allocator, PagedTokenToKVPoolAllocator | SWATokenToKVPoolAllocator)
            prefix_lens = [s.kv_len for s in seqs]
            seq_lens = [s.kv_len + e for s, e in zip(seqs, extend_lens, strict=True)]
            last_loc = [self.slot_of(s, s.kv_len - 1) if s.kv_len else -1 for s in seqs]
            if mode == "decode":
                slots = allocator.alloc_decode(seq_lens, last_loc)
            else:
                slots = allocator.alloc_extend(prefix_lens, seq_lens, last_loc, num_tokens)
        assert slots is not None, "test pools too small"
        return slots

    def slot_of(self, seq: Seq, position: int) -> int:
        assert seq.req_pool_idx is not None
        return int(self.rows.req_to_token[seq.req_pool_idx, position])

    # -- window freeing, poisoned --------------------------------------------------------

    def _free_out_of_window(self, seq: Seq) -> None:
        """Free the SWA half of positions that left the window, then NaN the freed SWA rows."""
        if seq.req_pool_idx is None or seq.kv_len == 0:
            return
        assert isinstance(self.allocator, SWATokenToKVPoolAllocator)
        window = self.config.sliding_window
        assert window is not None
        full = self.rows.read(seq.req_pool_idx, 0, seq.kv_len)
        before = self.allocator.translate_loc(full)
        seq.swa_frontier_len = free_swa_out_of_window(
            self.allocator, self.rows, seq.req_pool_idx, seq.swa_frontier_len, seq.kv_len, window
        )
        after = self.allocator.translate_loc(full)
        freed = before[(before > 0) & (after == 0)]
        self.num_swa_slots_freed += len(freed)
        for buffer in self.buffers(swa_only=True):
            buffer[freed] = float("nan")

    # -- sharing and invariants ----------------------------------------------------------

    def fork(self, parent: Seq, token_ids: list[int], shared_len: int) -> Seq:
        """A new request whose row points at the parent's slots for its first shared_len
        tokens (as a prefix cache hands out a matched prefix); shared_len page-aligned."""
        assert shared_len % self.page_size == 0 and shared_len <= parent.kv_len
        assert token_ids[:shared_len] == parent.token_ids[:shared_len]
        child = Seq(token_ids, kv_len=shared_len)
        self._hold_rows([child])
        assert parent.req_pool_idx is not None and child.req_pool_idx is not None
        self.rows.write(child.req_pool_idx, 0, self.rows.read(parent.req_pool_idx, 0, shared_len))
        return child

    def _hold_rows(self, seqs: list[Seq]) -> None:
        self.seqs += [s for s in seqs if s.req_pool_idx is None]
        assert self.rows.alloc(seqs) is not None, "test has too few rows"

    def check_integrity(self) -> None:
        owned = [slot for s in self.seqs for slot in s.owned_slots]
        self.allocator.check_integrity(owned)
        self.rows.check_integrity([s.req_pool_idx for s in self.seqs if s.req_pool_idx is not None])
