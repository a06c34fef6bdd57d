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
from typing import Any, NamedTuple

import numpy as np
import torch

from kvscope.engine.sampling_params import GREEDY, SamplingParams


class TokenLogprob(NamedTuple):
    """One output token's log-probability under the raw logits, and the top ones (best first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


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
    sampling: SamplingParams = GREEDY
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
    finish_reason: str | None = None  # "length" | "stop" once finish_check said done
    stop_token: int | None = None  # the stop_token_ids entry it stopped on
    stop_sequence: int | None = None  # the index of the stop sequence it stopped on
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when sampling.num_logprobs is set
    generator: torch.Generator | None = None  # the request's own draws (sampling.py)

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
        """Whether the last output ends the request (sampling_params.py's NOTE); sets finish_reason."""
        params, num_outputs = self.sampling, len(self.output_ids)
        if num_outputs >= self.max_new_tokens:
            self.finish_reason = "length"
        if num_outputs < params.min_tokens or not num_outputs:
            return self.finish_reason is not None
        last = self.output_ids[-1]
        if self.finish_reason is None and not params.ignore_eos and last == params.eos_id:
            self.finish_reason = "stop"
        elif self.finish_reason is None and last in params.stop_token_ids:
            self.finish_reason, self.stop_token = "stop", last
        for index, seq in enumerate(params.stop_sequences):
            if num_outputs >= len(seq) and tuple(self.output_ids[-len(seq) :]) == seq:
                self.finish_reason, self.stop_token, self.stop_sequence = "stop", None, index
                break
        return self.finish_reason is not None

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
