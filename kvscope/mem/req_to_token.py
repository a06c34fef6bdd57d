"""ReqToTokenPool: one int32 row per running request mapping token position -> slot (docs/memory-semantics.md §2.1).

NOTE: `req_to_token[row, i]` is the slot of position i of the request holding `row`.
Row 0 is padding (padded batches point at it); rows 1..num_rows are handed out.
`alloc` pops rows from the tail of the free list and bumps their generation; a request
that already holds a row (chunked prefill) keeps it. `free` appends the row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import torch

from kvscope.mem.base import PoolUsage
from kvscope.mem.device import resolve_device
from kvscope.mem.errors import IntegrityError, PoolMisuseError


class RowHolder(Protocol):
    """Anything that can hold a row: the engine's request, a test's stand-in."""

    req_pool_idx: int | None


class ReqToTokenPool:
    name = "req"

    def __init__(
        self,
        num_rows: int,
        max_context_len: int,
        device: str | torch.device | None = None,
        *,
        dtype: torch.dtype = torch.int32,
        strict: bool = False,
    ) -> None:
        if dtype not in (torch.int32, torch.int64):
            raise ValueError(f"[req] the slot table holds int32 or int64 slot indices, not {dtype}")
        if num_rows < 1 or max_context_len < 1:
            raise ValueError(f"[req] num_rows and max_context_len must be >= 1, got {num_rows}, {max_context_len}")
        self.num_rows = num_rows
        self.max_context_len = max_context_len
        self.device = resolve_device(device)
        self.strict = strict
        self.dtype = dtype
        self.req_to_token = torch.zeros((num_rows + 1, max_context_len), dtype=dtype, device=self.device)
        self.row_generation = [0] * (num_rows + 1)
        self.clear()

    def clear(self) -> None:
        self.free_rows: list[int] = list(range(1, self.num_rows + 1))
        self._is_free = np.ones(self.num_rows + 1, dtype=bool)
        self._is_free[0] = False

    def available_size(self) -> int:
        return len(self.free_rows)

    def usage(self) -> PoolUsage:
        return PoolUsage(self.num_rows, len(self.free_rows))

    def alloc(self, holders: Sequence[RowHolder]) -> list[int] | None:
        """Give each holder without a row a fresh row; None (nothing changed) if too few."""
        needy = [h for h in holders if h.req_pool_idx is None]
        if len(needy) > len(self.free_rows):
            return None
        for holder in needy:
            row = self.free_rows.pop()
            self._is_free[row] = False
            self.row_generation[row] += 1
            holder.req_pool_idx = row
        return [h.req_pool_idx for h in holders if h.req_pool_idx is not None]

    def free(self, holder: RowHolder) -> None:
        row = holder.req_pool_idx
        if row is None:
            raise PoolMisuseError(self.name, "freeing a request that holds no row")
        if self.strict:
            if row == 0:
                raise PoolMisuseError(self.name, "freeing the padding row", [0])
            if self._is_free[row]:
                raise PoolMisuseError(self.name, "double free of a row", [row])
        self._is_free[row] = True
        self.free_rows.append(row)
        holder.req_pool_idx = None

    def write(self, row: int, start_pos: int, slots: torch.Tensor) -> None:
        """Store `slots` as the slots of positions [start_pos, start_pos + len(slots))."""
        end_pos = start_pos + len(slots)
        if end_pos > self.max_context_len:
            raise PoolMisuseError(
                self.name, f"row {row}: position {end_pos} beyond max_context_len {self.max_context_len}"
            )
        self.req_to_token[row, start_pos:end_pos] = slots.to(self.dtype)

    def write_tokens(self, rows: Sequence[int | None], positions: Sequence[int], slots: torch.Tensor) -> None:
        """One slot per (row, position) pair, in one scatter: a decode step's new tokens."""
        index = torch.tensor([list(rows), list(positions)], dtype=torch.int64, device=self.device)
        self.req_to_token[index[0], index[1]] = slots.to(device=self.device, dtype=self.dtype)

    def read_tokens(self, rows: Sequence[int | None], positions: Sequence[int]) -> torch.Tensor:
        """The slot at each (row, position) pair, as int64, in one gather."""
        index = torch.tensor([list(rows), list(positions)], dtype=torch.int64, device=self.device)
        return self.req_to_token[index[0], index[1]].to(torch.int64)

    def read(self, row: int, start_pos: int, end_pos: int) -> torch.Tensor:
        """Slots of positions [start_pos, end_pos) as int64 (a new tensor)."""
        return self.req_to_token[row, start_pos:end_pos].to(torch.int64)

    def check_integrity(self, held_rows: Iterable[int] | None = None) -> None:
        rows = np.asarray(self.free_rows, dtype=np.int64)
        uniq, counts = np.unique(rows, return_counts=True)
        if (counts > 1).any():
            raise IntegrityError(f"[req] rows free twice: {uniq[counts > 1].tolist()}")
        if len(rows) and (rows.min() < 1 or rows.max() > self.num_rows):
            raise IntegrityError(f"[req] free rows out of range [1, {self.num_rows}]: {rows.tolist()}")
        if int((~self._is_free[1:]).sum()) != self.num_rows - len(rows):
            raise IntegrityError("[req] free-row bitmap disagrees with the free list")
        if held_rows is None:
            return
        held = np.asarray(list(held_rows), dtype=np.int64)
        every = np.concatenate((rows, held))
        if len(np.unique(every)) != len(every) or len(every) != self.num_rows or (held == 0).any():
            raise IntegrityError(
                f"[req] conservation broken: free {len(rows)} + held {len(held)} != {self.num_rows} rows"
            )
