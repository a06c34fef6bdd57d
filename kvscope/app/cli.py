"""The `kvscope` command: a router from the verb to its Command (kvscope/app/commands/).

Each verb's options and the call into its body live in its own module of commands/; this module
builds the parser from their list (COMMANDS) and turns a body's failure into one line and an
exit code. A Command's run returns the exit code. Bad input raises ValueError, OSError or
CaptureError with one line, which `main` prints as `kvscope <verb>: error: <line>` and exits 2;
a stop signal exits 128 + its number with one line (kvscope/__main__.py).
A malformed flag value is argparse's error, printed the same way (commands.Parser). Sizes take unit
suffixes (units.py); help states each default once (commands.HelpFormatter).

NOTE: runner.py, demo.py and serve.py load torch, so a Command imports its body only in its run:
`--help`, the capture readers, `plan`, `replay` and `instrument` never load it (replays run in workers).
NOTE: `instrument` (LONE_VERBS) builds a parser of its verb alone: the other verbs' modules are never
imported, nor the store (CaptureError is read only when something raised: capture_error()), so it
execs the engine without loading numpy, pandas or SQLAlchemy (figures: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvscope import __version__
from kvscope.app.commands import HelpFormatter, Parser, add_command, all_commands, command

if TYPE_CHECKING:
    from kvscope.app.commands.engine_options import POLICY_HELP

__all__ = ["POLICY_HELP", "build_parser", "main"]


LONE_VERBS = ("instrument",)  # NOTE: parsed alone: their start is another program's (the engine's)


def __getattr__(name: str) -> Any:
    if name == "POLICY_HELP":
        from kvscope.app.commands import POLICY_HELP

        return POLICY_HELP
    raise AttributeError(f"module 'kvscope.app.cli' has no attribute {name!r}")


def verb_of(argv: Sequence[str]) -> str:
    """The verb before argparse has run: the first argument that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), "")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every verb's parser; `only`: that verb's alone (the others' modules are not imported)."""
    parser = Parser(
        prog="kvscope",
        description="Observability dashboard and memory debugger for SGLang-style KV-cache memory.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for each in (command(only),) if only else all_commands():
        add_command(verbs, each)
    return parser


class _NoCaptureError(Exception):
    """Stands for CaptureError while no capture was opened (nothing can have raised it)."""


def capture_error() -> type[Exception]:
    """CaptureError once the store is loaded: a verb that never opens a capture (instrument) never
    imports it, nor SQLAlchemy (an except clause's classes are read only when something raised)."""
    store = sys.modules.get("kvscope.telemetry.store")
    return _NoCaptureError if store is None else store.CaptureError


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = verb_of(argv)
    args = build_parser(verb if verb in LONE_VERBS else None).parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, OSError, capture_error()) as err:
        print(f"kvscope {args.verb}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C; SIGTERM and SIGHUP too, through kvscope.__main__
        print(f"kvscope {args.verb}: interrupted", file=sys.stderr)
        return 128 + getattr(stop, "signum", signal.SIGINT)
    return code
