"""Admission to a prefill batch: SGLang's PrefillAdder budget (docs/memory-semantics.md §9.2).

NOTE: budgets in tokens, rebuilt for every prefill pass
    rem_total = available + evictable - reserved   (SWA: the smaller over the two pools)
        reserved starts at Σ_running min(max_new - len(out), CLIP) * new_token_ratio and grows
        by page_ceil(extend) + min(max_new, CLIP) + page_size per admitted request
    rem_input = max_prefill_tokens, rem_chunk = chunked_prefill_size (None: no chunking)
A request is admitted if extend + max_new + page_size < rem_total, re-checked after its
prefix is locked (locking shrinks evictable). A prompt longer than rem_chunk is cut to a
page-aligned chunk and ends the batch. The in-flight chunked request goes first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.memory import MemorySystem
from kvscope.engine.request import Req


@dataclass
class Admission:
    req: Req
    extend_len: int  # tokens this round computes


class PrefillAdder:
    def __init__(
        self,
        memory: MemorySystem,
        running: Sequence[Req],
        new_token_ratio: float,
        clip: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
    ) -> None:
        self.memory = memory
        self.page_size = memory.page_size
        self.clip = clip
        self.reserved = sum(min(r.max_new_tokens - len(r.output_ids), clip) for r in running) * new_token_ratio
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunked_prefill_size
        self.admitted: list[Admission] = []
        self.batch_full = False

    def rem_total(self) -> float:
        return self.memory.reclaimable_size() - self.reserved

    def _page_ceil(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) * self.page_size

    def add_chunked(self, req: Req) -> None:
        """The in-flight chunked request must run, or its locked prefix would leak."""
        remaining = req.all_len - req.kv_committed_len
        limit = min(self.rem_chunk or remaining, int(self.rem_total()) - self.page_size)
        if limit <= 0:
            limit = self.rem_chunk or remaining
        self._admit(req, req.kv_committed_len, self._chunk_len(req.kv_committed_len, remaining, limit), max_new=0)

    def _chunk_len(self, prefix_len: int, remaining: int, limit: int) -> int:
        """All that remains if it fits, else a chunk that ends on a page boundary."""
        if remaining <= limit:
            return remaining
        end = (prefix_len + limit) // self.page_size * self.page_size
        return max(end - prefix_len, 0)

    def try_add(self, req: Req, prefix_len: int) -> bool:
        """Budget a matched request whose prefix the caller has locked. Admitted requests are in
        `self.admitted` (a chunked one too, though it returns False: it ends the batch)."""
        extend = req.all_len - prefix_len
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), self.clip)
        if extend + max_new + self.page_size >= self.rem_total():
            self.batch_full = True
            return False
        if self.rem_chunk is None and self.admitted and self._page_ceil(extend) >= self.rem_input:
            return False
        if self.rem_chunk is not None and extend > self.rem_chunk:
            chunk = self._chunk_len(prefix_len, extend, self.rem_chunk)
            if chunk <= 0:
                return False
            self._admit(req, prefix_len, chunk, max_new=0)
            return False  # a chunked request ends the batch
        self._admit(req, prefix_len, extend, max_new)
        return True

    def load_quota(self, req: Req, prefix_len: int) -> int:
        """The device tokens a load-back may take for `req` if its prefix grows to `prefix_len`:
        what the budget leaves after the request itself (hiradix's mem_quota)."""
        extend = req.all_len - prefix_len
        max_new = min(max(req.max_new_tokens - len(req.output_ids), 0), self.clip)
        return int(self.rem_total()) - (extend + max_new + self.page_size)

    def _admit(self, req: Req, prefix_len: int, extend_len: int, max_new: int) -> None:
        self.reserved += self._page_ceil(extend_len) + max_new + self.page_size
        self.rem_input -= extend_len
        if self.rem_chunk is not None:
            self.rem_chunk -= extend_len
        req.extend_len = extend_len
        req.is_chunked = prefix_len + extend_len < req.all_len
        self.admitted.append(Admission(req, extend_len))
