"""The retention options `run` and `serve` share (docs/captures.md, Retention): how long, or how much,
a run keeps of its raw events; runner.retention_from_args reads them."""

from __future__ import annotations

import argparse

from kvscope.app.units import duration_s
from kvscope.telemetry.retention import parse_size_bytes

SERVE_MAX_SIZE = "4GiB"  # NOTE: a server runs for weeks: its capture stays under a few GB by default


def max_size(text: str) -> int | None:
    """A size with its unit, read as KVSCOPE_MAX_SIZE is (retention.parse_size_bytes), or 'none' for no
    size bound."""
    if text.strip().lower() in ("none", "off", "0"):
        return None
    try:
        return parse_size_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_retention_options(parser: argparse.ArgumentParser, *, default_max_size: str | None = None) -> None:
    default = f" (default {default_max_size}; 'none': no bound)" if default_max_size else " (default: none)"
    parser.add_argument(
        "--keep-events",
        type=duration_s,
        metavar="DURATION",
        help="keep the run's raw events for this long (90s, 30m, 6h, 7d), dropping the oldest whole chunks; "
        "leak checks, requests, usage and tree snapshots are kept for the run's whole life",
    )
    parser.add_argument(
        "--max-size",
        type=max_size,
        default=None if default_max_size is None else max_size(default_max_size),
        metavar="SIZE",
        help="keep the capture under this size (512MiB, 20GiB, 20GB) by dropping the run's oldest events" + default,
    )
