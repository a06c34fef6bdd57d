"""A request as the scheduler and the caches see it (docs/memory-semantics.md §3).

NOTE: positions of a running request
    [0, cache_protected_len)        slots owned by the tree (locked through last_node)
    [cache_protected_len, kv_len)   slots owned by the request (kv_len = kv_committed_len)
    all_ids = prompt + outputs; the last output has no KV yet: it is the next decode input.
`fill_ids` is what the cache inserts: all_ids up to the end of this round's extend
(chunked prefill truncates it), or all_ids once the prompt is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import torch


class ReqState(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Req:
    rid: str
    prompt_ids: np.ndarray
    max_new_tokens: int
    user: str | None = None
    forced_output_ids: np.ndarray | None = None  # a trace's outputs, emitted instead of sampling
    ignore_eos: bool = True
    eos_id: int | None = None
    arrival_step: int = 0

    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    fill_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    kv_committed_len: int = 0
    cache_protected_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    swa_lock_id: int | None = None
    swa_evicted_len: int = 0
    extend_len: int = 0  # tokens computed in the current prefill round
    is_chunked: bool = False
    decode_steps: int = 0
    num_retractions: int = 0
    cached_tokens: int = 0  # prefix hit at first admission
    admitted: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.rid}: max_new_tokens must be >= 1")
        if len(self.prompt_ids) < 1:
            raise ValueError(f"request {self.rid}: empty prompt")
        self._ids = np.zeros(len(self.prompt_ids) + self.max_new_tokens, dtype=np.int32)
        self._ids[: len(self.prompt_ids)] = self.prompt_ids
        self.fill_ids = self._ids[: len(self.prompt_ids)]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    def all_ids(self) -> np.ndarray:
        """prompt + outputs, a view into the request's buffer."""
        return self._ids[: self.all_len]

    def append_output(self, token_id: int) -> None:
        self._ids[self.all_len] = token_id
        self.output_ids.append(token_id)

    def next_token(self, sampled: int) -> int:
        """The token to emit: the trace's forced output if it has one, else the sampled one."""
        forced = self.forced_output_ids
        return int(forced[len(self.output_ids)]) if forced is not None else sampled

    def is_done(self) -> bool:
        if len(self.output_ids) >= self.max_new_tokens:
            return True
        return not self.ignore_eos and bool(self.output_ids) and self.output_ids[-1] == self.eos_id

    def reset_for_retract(self, root: Any) -> None:
        """Back to waiting with outputs kept (docs/memory-semantics.md §9.3): the tree forgets it, its KV is gone."""
        self.state = ReqState.WAITING
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = root
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.swa_lock_id = None
        self.swa_evicted_len = 0
        self.is_chunked = False
        self.num_retractions += 1
        self.fill_ids = self.all_ids()
