"""Numbers on the command line: token counts and memory sizes with unit suffixes, and rates.

NOTE: the suffixes (case-insensitive; a fraction is fine where the result is whole)
    token counts   200000, 200k = 200,000, 1.5M = 1,500,000, 1G = 10^9     decimal
                   128Ki = 131,072, 4Mi = 4,194,304, 1Gi = 2^30             binary
    memory sizes   a bare number is GiB (80 = 80 GiB)
                   80G = 80GiB = 80Gi, 512M = 512MiB, 4K = 4KiB, 1T = 1TiB   binary, as GPUs count
                   80GB = 80 x 10^9, 512MB = 512 x 10^6                    decimal, spelled out
                   4096B = 4096 bytes
Each parser is an argparse `type`: bad text raises ArgumentTypeError with the accepted forms.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from fractions import Fraction

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
COUNT_SCALES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
BYTE_SCALES = {
    "": 2**30, "b": 1,
    **{p: 2 ** (10 * (k + 1)) for k, p in enumerate("kmgt")},
    **{f"{p}i": 2 ** (10 * (k + 1)) for k, p in enumerate("kmgt")},
    **{f"{p}ib": 2 ** (10 * (k + 1)) for k, p in enumerate("kmgt")},
    **{f"{p}b": 10 ** (3 * (k + 1)) for k, p in enumerate("kmgt")},
}
GIB = 2**30


def _scaled(text: str, scales: dict[str, int], whole: bool) -> int | None:
    """`text` times its suffix's scale (exact; floored unless `whole`, which rejects a fraction);
    None when malformed."""
    match = re.fullmatch(rf"\s*{_NUMBER}\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].lower() not in scales:
        return None
    value = Fraction(match[1]) * scales[match[2].lower()]
    if whole and value.denominator != 1:
        return None
    return math.floor(value)


def token_count(text: str) -> int:
    """A token count >= 0: 4096, 4k, 1.5M, 128Ki."""
    value = _scaled(text, COUNT_SCALES, whole=True)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole token count (write 4096, 4k, 1.5M or 128Ki)")
    return value


def positive_count(text: str) -> int:
    """A count >= 1, with the token-count suffixes."""
    value = token_count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def thread_count(text: str) -> int | None:
    """A thread count >= 1, or "auto" (None: the caller's default)."""
    if text.strip().lower() == "auto":
        return None
    if not re.fullmatch(r"\d+", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a thread count (a whole number >= 1, or auto)")
    return int(text)


def port_number(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    if not re.fullmatch(r"\d{1,5}", text.strip()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535; 0: any free port)")
    return int(text)


def byte_size(text: str) -> int:
    """A memory size in bytes (floored): 80 (GiB), 79.6, 80G, 80GiB, 512MiB, 80GB (decimal)."""
    value = _scaled(text, BYTE_SCALES, whole=False)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size (write 80 for GiB, 80G, 80GiB, 512MiB or 80GB for 10^9 bytes)")
    return value


def token_counts(text: str) -> list[int]:
    """Comma-separated token counts, at least one."""
    values = [token_count(item) for item in text.split(",") if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError("no capacities given")
    return values


def finite_float(low: float, high: float = math.inf, *, low_open: bool = True) -> Callable[[str], float]:
    """A float type in (low, high] (or [low, high] with low_open=False); nan and inf are rejected."""
    bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or value > high:
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    return parse


def gib_text(num_bytes: int) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"
