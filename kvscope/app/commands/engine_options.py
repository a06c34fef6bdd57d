"""The engine's options that `run` and `serve` share, and the scoped-radix ones `replay` shares too
(runner.engine_from_args, runner.scoped_options and runner.host_cache_options read them)."""

from __future__ import annotations

import argparse

from kvscope.app.commands.base import add_old_spelling
from kvscope.app.units import (
    finite_float,
    on_off,
    pinned_file,
    positive_count,
    promote_threshold,
    thread_count,
    token_count,
)
from kvscope.engine import AUTO, CACHE_KINDS
from kvscope.engine import cli_help as cache_help
from kvscope.engine.config import SCHEDULE_POLICIES, WRITE_POLICIES

POLICY_HELP = "lru, lfu, fifo, mru, filo, priority, slru"


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's options, the same for `run` and `serve` (runner.engine_from_args reads them)."""
    parser.add_argument(
        "--model", default="tiny", help="tiny, tiny-swa, or a shape like 'layers=4,hidden=64,window=32'"
    )
    parser.add_argument("--cache", default=AUTO, choices=[AUTO, *CACHE_KINDS], help=cache_help())
    parser.add_argument("--eviction-policy", default="lru", help=POLICY_HELP)
    parser.add_argument(
        "--eviction-granularity",
        default="leaf",
        choices=["leaf", "page"],
        help="leaf: SGLang's whole-leaf eviction; page: only the pages needed",
    )
    parser.add_argument("--page-size", type=int, default=1, help="tokens per KV page (a power of two)")
    parser.add_argument(
        "--kv-tokens",
        type=token_count,
        default=4096,
        metavar="TOKENS",
        help="KV capacity of the full pool, in tokens (4096, 64k, 1.5M, 128Ki)",
    )
    add_old_spelling(
        parser,
        parser.add_argument(
            "--swa-full-tokens-ratio",
            dest="swa_ratio",
            type=finite_float(0, 1),
            default=0.8,
            metavar="RATIO",
            help="SWA pool size as a fraction of the full pool",
        ),
    )
    parser.add_argument(
        "--chunked-prefill-size",
        type=token_count,
        default=256,
        metavar="TOKENS",
        help="tokens per prefill chunk; 0 disables",
    )
    parser.add_argument(
        "--max-running-requests", type=positive_count, default=32, metavar="N", help="request rows in req_to_token"
    )
    parser.add_argument(
        "--max-context-len",
        type=positive_count,
        default=2048,
        metavar="TOKENS",
        help="longest prompt + output, in tokens (2048, 8k, 128Ki)",
    )
    parser.add_argument(
        "--schedule-policy",
        default="fcfs",
        choices=SCHEDULE_POLICIES,
        help="waiting-queue order: fcfs (arrival) or lpm (longest cached prefix the request's "
        "principal can see first; arrival order above 128 waiting)",
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu or cuda")
    parser.add_argument("--strict", action="store_true", help="pools and caches check every call for misuse")
    parser.add_argument(
        "--torch-threads",
        type=thread_count,
        default="auto",
        metavar="N|auto",
        help="torch's intra-op threads in the engine's process. auto: as torch chooses (one per "
        "core) for run; for serve on the CPU one fewer than the usable cores, leaving a core "
        "to the HTTP front",
    )
    add_scoped_options(parser, "monotonic time")
    add_host_options(parser)


def add_host_options(parser: argparse.ArgumentParser) -> None:
    """The hiradix cache's options; None where not given, so that a reader can refuse them
    without --cache hiradix (runner.host_cache_options)."""
    group = parser.add_argument_group("host tier (--cache hiradix only)")
    group.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        help="when a node is copied to the host: write_through at its first insert, "
        "write_through_selective at its second, write_back on device eviction (default: write_through)",
    )
    group.add_argument(
        "--host-ratio",
        type=finite_float(0),
        metavar="RATIO",
        help="host pool size as a multiple of the device pool (default: 2.0)",
    )
    group.add_argument(
        "--host-tokens",
        type=positive_count,
        metavar="TOKENS",
        help="host pool size in tokens (overrides --host-ratio); as SGLang sizes it, the pool gets one page "
        "more than the whole pages that fit (2048 at page size 1: 2049 tokens)",
    )


def add_scoped_options(parser: argparse.ArgumentParser, clock: str) -> None:
    """The scoped-radix cache's options (run, serve, replay); None where not given, so that a
    reader can refuse them without --cache scoped-radix (runner.scoped_options)."""
    group = parser.add_argument_group("tenant isolation (--cache scoped-radix only)")
    group.add_argument(
        "--promote-k",
        type=promote_threshold,
        metavar="K|inf",
        help="a private node turns public once K distinct principals computed it within the "
        "window (two epochs); inf never promotes: per-principal isolation (default: 3)",
    )
    group.add_argument(
        "--epoch-s",
        type=finite_float(0),
        metavar="SECONDS",
        help=f"length of one epoch of the promotion window, in {clock} (default: 60)",
    )
    group.add_argument(
        "--pinned",
        type=pinned_file,
        metavar="FILE",
        help="operator-declared public prefixes (system prompts), JSONL: per line a list of token "
        'ids, {"prompt": [ids]} or {"text": "..."} (byte tokenizer)',
    )
    group.add_argument(
        "--dedup",
        type=on_off,
        metavar="on|off",
        help="on: a principal's recomputed copy of a node it cannot see shares that node's KV "
        "(saves memory, may leak through capacity); off: it keeps a private copy (default: off)",
    )
    group.add_argument(
        "--merge-chains",
        action="store_true",
        default=None,
        help="merge private unary chains into one node (an optimization)",
    )
