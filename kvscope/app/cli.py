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
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from kvscope import __version__
from kvscope.app.commands import COMMANDS, POLICY_HELP, HelpFormatter, Parser, add_command
from kvscope.telemetry import CaptureError

__all__ = ["POLICY_HELP", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvscope",
        description="Observability dashboard and memory debugger for SGLang-style KV-cache memory.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for command in COMMANDS:
        add_command(verbs, command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, OSError, CaptureError) as err:
        print(f"kvscope {args.verb}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C; SIGTERM and SIGHUP too, through kvscope.__main__
        print(f"kvscope {args.verb}: interrupted", file=sys.stderr)
        return 128 + getattr(stop, "signum", signal.SIGINT)
    return code
