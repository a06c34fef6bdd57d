"""Values on the command line: token counts and memory sizes with unit suffixes, rates, and the
scoped cache's settings (a promotion threshold, on/off switches, a file of pinned prefixes).

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
import json
import math
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvscope.engine import cache_kind, either, kinds_with
from kvscope.workloads import ByteTokenizer

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
COUNT_SCALES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
BYTE_SCALES = {
    "": 2**30,
    "b": 1,
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
            f"{text!r} is not a memory size (write 80 for GiB, 80G, 80GiB, 512MiB or 80GB for 10^9 bytes)"
        )
    return value


def duration_s(text: str) -> float:
    """'90s', '30m', '6h', '7d' (a bare number is seconds) as seconds."""
    from kvscope.telemetry.retention import parse_duration_s

    try:
        return parse_duration_s(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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


SCOPED_OPTIONS = {
    "promote_k": "--promote-k",
    "epoch_s": "--epoch-s",
    "pinned": "--pinned",
    "dedup": "--dedup",
    "merge_chains": "--merge-chains",
}
SCOPED_DEFAULTS: dict[str, Any] = {"promote_k": 3, "epoch_s": 60.0, "pinned": (), "dedup": False, "merge_chains": False}


def scoped_cache_options(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The scoped cache's settings from `args` (cli.add_scoped_options), defaults filled in;
    ValueError naming the flags when any is given for another cache kind."""
    given = {name: getattr(args, name) for name in SCOPED_OPTIONS if getattr(args, name, None) is not None}
    if given and not cache_kind(kind).scoped:
        flags = ", ".join(SCOPED_OPTIONS[name] for name in given)
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"{flags} {verb} to --cache {either(kinds_with(lambda spec: spec.scoped))} only, not {kind}")
    options = {**SCOPED_DEFAULTS, **given}
    if options["promote_k"] == math.inf:
        options["promote_k"] = None  # NOTE: the caches' spelling of "never promote"
    return options


def promote_threshold(text: str) -> float:
    """The scoped cache's promotion threshold: a whole number >= 1, or inf (math.inf: never promote)."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    if not re.fullmatch(r"\d+", text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a promotion threshold (a whole number >= 1, or inf)")
    return int(text)


def on_off(text: str) -> bool:
    """on or off (also true/false, yes/no, 1/0)."""
    value = text.strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not on or off")


def pinned_prefixes(path: str | Path) -> tuple[tuple[int, ...], ...]:
    """The pinned prefixes of a JSONL file. Each non-blank line is one prefix: a JSON list of
    token ids, {"prompt": [ids]}, or {"text": "..."} (ByteTokenizer's ids). ValueError naming
    the file and the line for a bad line; OSError when the file cannot be read."""
    prefixes = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    prefixes.append(_pinned_prefix(json.loads(line)))
                except (json.JSONDecodeError, ValueError) as err:
                    raise ValueError(f"{path} line {number}: {_one_line(err)}") from None
    return tuple(prefixes)


def pinned_file(text: str) -> tuple[tuple[int, ...], ...]:
    """`pinned_prefixes` as an argparse type: a bad file or line is one ArgumentTypeError line."""
    try:
        return pinned_prefixes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{text}: {err.strerror or err}") from None


def _pinned_prefix(record: Any) -> tuple[int, ...]:
    if isinstance(record, dict) and set(record) == {"text"} and isinstance(record["text"], str):
        ids = tuple(int(i) for i in ByteTokenizer().encode(record["text"]))
    elif isinstance(record, dict) and set(record) == {"prompt"}:
        ids = _token_ids(record["prompt"])
    elif isinstance(record, list):
        ids = _token_ids(record)
    else:
        raise ValueError('expected a list of token ids, {"prompt": [ids]} or {"text": "..."}')
    if not ids:
        raise ValueError("the prefix is empty")
    return ids


def _token_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or any(type(i) is not int or not 0 <= i < 2**31 for i in value):
        raise ValueError("token ids must be a list of ints in [0, 2^31)")
    return tuple(value)


def _one_line(err: Exception) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"not JSON ({err.msg}, column {err.colno})"
    return str(err)


def gib_text(num_bytes: int) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"
