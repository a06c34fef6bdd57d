"""ForwardBatch: the new tokens of one forward pass and where their KV lives.

NOTE: index map of request i (row r = req_pool_indices[i], p = prefix_lens[i],
e = extend_lens[i]), positions of its request:
    [0, p)      already in the KV pool: req_to_token[r, 0:p] are their full slots
    [p, p + e)  the new tokens of this forward: input_ids / positions / out_cache_loc
                [sum(extend_lens[:i]), sum(extend_lens[:i + 1])); the caller has already
                written out_cache_loc into req_to_token[r, p:p + e]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

ForwardMode = Literal["extend", "decode"]


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64 full-pool slots

    def __post_init__(self) -> None:
        num_requests = len(self.req_pool_indices)
        if num_requests == 0:
            raise ValueError("a forward batch needs at least one request")
        if len(self.prefix_lens) != num_requests or len(self.extend_lens) != num_requests:
            raise ValueError(
                f"per-request lists disagree: {num_requests} rows, {len(self.prefix_lens)} prefix_lens, "
                f"{len(self.extend_lens)} extend_lens"
            )
        if min(self.extend_lens) < 1 or min(self.prefix_lens) < 0:
            raise ValueError(
                f"extend_lens must be >= 1 and prefix_lens >= 0, got {self.extend_lens}, {self.prefix_lens}"
            )
        if self.mode == "decode" and max(self.extend_lens) != 1:
            raise ValueError(f"decode extends every request by one token, got extend_lens {self.extend_lens}")
        num_tokens = sum(self.extend_lens)
        sizes = {name: getattr(self, name).numel() for name in ("input_ids", "positions", "out_cache_loc")}
        if any(size != num_tokens for size in sizes.values()):
            raise ValueError(f"sum(extend_lens) = {num_tokens} new tokens, but tensor sizes are {sizes}")

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: Sequence[int] | torch.Tensor,
        req_pool_indices: Sequence[int],
        prefix_lens: Sequence[int],
        out_cache_loc: torch.Tensor,
        extend_lens: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """Positions from the lengths; tensors on out_cache_loc's device, one copy each.

        `extend_lens` defaults to one token per request (decode).
        """
        device = out_cache_loc.device
        ext = list(extend_lens) if extend_lens is not None else [1] * len(req_pool_indices)
        prefix = list(prefix_lens)
        if len(ext) != len(prefix):
            raise ValueError(f"{len(prefix)} prefix_lens but {len(ext)} extend_lens")
        positions = torch.from_numpy(token_positions(prefix, ext))
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(list(input_ids), dtype=torch.int64)
        return cls(
            mode=mode,
            input_ids=ids.to(device=device, dtype=torch.int64),
            positions=positions.to(device),
            req_pool_indices=list(req_pool_indices),
            prefix_lens=prefix,
            extend_lens=ext,
            out_cache_loc=out_cache_loc.to(torch.int64),
        )

    @property
    def num_requests(self) -> int:
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        """Tokens per request once this forward has run (prefix plus new)."""
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]


def token_positions(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> np.ndarray:
    """Positions [p, p + e) of every request's new tokens, concatenated (int64, host)."""
    ext = np.asarray(extend_lens, dtype=np.int64)
    token_start = np.cumsum(ext) - ext
    shift = np.asarray(prefix_lens, dtype=np.int64) - token_start
    return np.arange(int(ext.sum()), dtype=np.int64) + np.repeat(shift, ext)
