"""Seeded draws shared by the generators: token ids, per-request lengths, arrival times.

NOTE: lengths. Shared parts (system prompts, instructions, examples, root prompts) have
exactly their option's length L. Per-request parts (suffixes, questions, new turns,
outputs) vary uniformly in [L - L//2, L + L//2] (never below 1), so page boundaries fall
at different offsets from request to request.
NOTE: token ids are drawn from [NUM_SPECIAL, vocab_size): never pad, bos or eos.
NOTE: arrivals use their own random stream (seed, 1), so the same seed gives the same
tokens with or without `rate_per_s`.
"""

from __future__ import annotations

import math

import numpy as np

from kvscope.workloads.request import TOKEN_DTYPE
from kvscope.workloads.tokenizer import NUM_SPECIAL

_ARRIVAL_STREAM = 1


class TokenSource:
    """One seeded random stream for a generator's token ids, lengths and choices."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size

    @property
    def num_usable(self) -> int:
        """How many ids a generator may draw."""
        return self.vocab_size - NUM_SPECIAL

    def tokens(self, length: int) -> np.ndarray:
        """`length` ids in [NUM_SPECIAL, vocab_size), drawn with replacement."""
        return self.rng.integers(NUM_SPECIAL, self.vocab_size, size=length, dtype=TOKEN_DTYPE)

    def varied_len(self, length: int) -> int:
        """A per-request length around `length` (see the note on lengths)."""
        return int(self.rng.integers(max(1, length - length // 2), length + length // 2 + 1))

    def varied_tokens(self, length: int) -> np.ndarray:
        return self.tokens(self.varied_len(length))

    def pick(self, num_choices: int) -> int:
        return int(self.rng.integers(num_choices))


def check_common(num_requests: int, seed: int, vocab_size: int, rate_per_s: float | None) -> None:
    """The arguments every generator takes, checked once with clear messages."""
    check_int("num_requests", num_requests, minimum=0)
    check_int("seed", seed, minimum=0)
    check_int("vocab_size", vocab_size, minimum=NUM_SPECIAL + 1)
    if rate_per_s is not None and (
        isinstance(rate_per_s, bool) or not isinstance(rate_per_s, int | float) or not 0 < rate_per_s < math.inf
    ):
        raise ValueError(f"rate_per_s must be a finite number > 0 or None, got {rate_per_s!r}")


def check_int(name: str, value: int, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def arrival_times(seed: int, num_requests: int, rate_per_s: float | None) -> list[float | None]:
    """Arrival seconds of a Poisson process at `rate_per_s` (exponential gaps, the first
    one included), or all None when no rate is given."""
    if rate_per_s is None:
        return [None] * num_requests
    gaps_s = np.random.default_rng([seed, _ARRIVAL_STREAM]).exponential(1.0 / rate_per_s, size=num_requests)
    return [float(t) for t in np.cumsum(gaps_s)]


def check_ints(minimum: int, **values: int) -> None:
    for name, value in values.items():
        check_int(name, value, minimum)
