"""The contract of a `kvscope` verb (`Command`) and the parser pieces every verb shares.

A verb is one module of this package holding one Command: its name, the one-line help of
`kvscope --help`, the description of `kvscope VERB --help`, `add_arguments(parser)` and
`run(args) -> int`, the exit code. cli.py only routes: it adds each Command's subparser
(`add_command`) and calls the chosen one's `run`.

NOTE: a verb module is imported for every `kvscope` call, `--help` included: it imports only
argparse, the option types (units.py) and light registries at module level; its body (report.py,
plan.py, runner.py ...) is imported inside `run`. runner.py, serve.py and demo.py load torch.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn, Protocol

SubParsers = Any  # argparse._SubParsersAction, private in typeshed
# NOTE: one flag name per concept across verbs; an older spelling still parses, hidden from --help
# (docs/cli.md lists them): old spelling -> the name every verb uses now
OLD_SPELLINGS = {
    "--swa-ratio": "--swa-full-tokens-ratio",  # run, serve (plan and SGLang say --swa-full-tokens-ratio)
    "--pace": "--rate",  # run (load and make run say --rate)
    "--eviction": "--eviction-granularity",  # replay (run and serve say --eviction-granularity)
    "--policy": "--eviction-policy",  # replay
    "--duration": "--duration-s",  # load (attach says --duration-s)
    "--timeout": "--timeout-s",  # load
    "--delay": "--delay-s",  # demo
}


class Command(Protocol):
    """One verb (or one topic of a verb, as `report leaks`).

    add_arguments only declares options on the parser it is given (its own subparser); run
    returns the exit code and reports bad input by raising ValueError, OSError or CaptureError
    with one line (cli.main prints it and exits 2)."""

    name: str
    help: str
    description: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, `kvscope <verb>: error: <line>`, exit 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" only where the help states no default of its own and there is
    one to state (not None, a flag's False, or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default == []:
            return text
        return super()._get_help_string(action)


def add_command(verbs: SubParsers, command: Command) -> argparse.ArgumentParser:
    """The command's subparser under `verbs`, its options declared, `args.func` its run."""
    parser: argparse.ArgumentParser = verbs.add_parser(
        command.name, help=command.help, description=command.description, formatter_class=HelpFormatter
    )
    command.add_arguments(parser)
    parser.set_defaults(func=command.run)
    return parser


def add_old_spelling(parser: argparse.ArgumentParser, new: argparse.Action) -> None:
    """The older spelling of `new` (OLD_SPELLINGS): the same value into the same attribute,
    hidden from --help; the default is `new`'s."""
    (old,) = [old for old, name in OLD_SPELLINGS.items() if name in new.option_strings]
    alias = parser.add_argument(
        old, dest=new.dest, choices=new.choices, metavar=new.metavar, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    alias.type = new.type
