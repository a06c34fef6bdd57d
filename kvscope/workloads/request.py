"""One request of a workload or trace: who sends it, its prompt, its output budget, when it arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

TOKEN_DTYPE = np.int32
_INT32_MAX = int(np.iinfo(np.int32).max)


def token_array(value: Any, field: str) -> np.ndarray:
    """`value` as a new read-only 1-D int32 array; ValueError naming `field` otherwise."""
    raw = np.asarray(value)
    if raw.ndim != 1:
        raise ValueError(f"{field} must be 1-D, got shape {raw.shape}")
    if raw.size and raw.dtype.kind not in "iu":
        raise ValueError(f"{field} must hold integer token ids, got dtype {raw.dtype}")
    if raw.size and (int(raw.min()) < 0 or int(raw.max()) > _INT32_MAX):
        raise ValueError(f"{field} token ids must lie in [0, {_INT32_MAX}], got [{raw.min()}, {raw.max()}]")
    ids = raw.astype(TOKEN_DTYPE)  # always a copy, so the caller's array can't change ours
    ids.flags.writeable = False
    return ids


@dataclass(frozen=True, eq=False)
class TraceRequest:
    """A request as a workload generator or a trace file describes it.

    `prompt_ids` is a non-empty read-only 1-D int32 array. `output_len` >= 1 tokens are
    generated; when `output_ids` is given (length == output_len) the engine forces those
    tokens instead of sampling, so a later request that repeats them (the next chat turn)
    really shares the prefix. `arrival_s` is seconds from the start of the trace (>= 0), or
    None for "all at once". Equality compares every field, arrays by value.
    """

    rid: str
    user: str | None
    prompt_ids: np.ndarray
    output_len: int
    output_ids: np.ndarray | None = None
    arrival_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str) or not self.rid:
            raise ValueError(f"rid must be a non-empty str, got {self.rid!r}")
        if self.user is not None and not isinstance(self.user, str):
            raise ValueError(f"request {self.rid}: user must be a str or None, got {type(self.user).__name__}")
        prompt_ids = token_array(self.prompt_ids, f"request {self.rid}: prompt_ids")
        if prompt_ids.size == 0:
            raise ValueError(f"request {self.rid}: prompt_ids is empty")
        object.__setattr__(self, "prompt_ids", prompt_ids)
        self._check_output()
        self._check_arrival()

    def _check_output(self) -> None:
        if type(self.output_len) is not int or self.output_len < 1:
            raise ValueError(f"request {self.rid}: output_len must be an int >= 1, got {self.output_len!r}")
        if self.output_ids is None:
            return
        output_ids = token_array(self.output_ids, f"request {self.rid}: output_ids")
        if output_ids.size != self.output_len:
            raise ValueError(
                f"request {self.rid}: output_ids has {output_ids.size} tokens but output_len is {self.output_len}"
            )
        object.__setattr__(self, "output_ids", output_ids)

    def _check_arrival(self) -> None:
        if self.arrival_s is None:
            return
        if isinstance(self.arrival_s, bool) or not isinstance(self.arrival_s, int | float):
            raise ValueError(f"request {self.rid}: arrival_s must be a number, got {type(self.arrival_s).__name__}")
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"request {self.rid}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        object.__setattr__(self, "arrival_s", float(self.arrival_s))

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TraceRequest):
            return NotImplemented
        same_outputs = (self.output_ids is None and other.output_ids is None) or (
            self.output_ids is not None
            and other.output_ids is not None
            and np.array_equal(self.output_ids, other.output_ids)
        )
        return (
            (self.rid, self.user, self.output_len, self.arrival_s)
            == (other.rid, other.user, other.output_len, other.arrival_s)
            and np.array_equal(self.prompt_ids, other.prompt_ids)
            and same_outputs
        )

    def __hash__(self) -> int:
        return hash((self.rid, self.user, self.output_len, self.prompt_ids.tobytes()))
