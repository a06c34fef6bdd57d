"""The `kvscope` command's entry point (`python -m kvscope` and the console script).

It installs the signal handling before anything heavy is imported, so a Ctrl-C or a SIGTERM
in the first seconds of any verb (while pandas or torch load) ends with one line, not a
traceback:

    SIGINT   kvscope <verb>: interrupted   exit 130
    SIGTERM  kvscope <verb>: interrupted   exit 143
    SIGHUP   kvscope <verb>: interrupted   exit 129

NOTE: once the verb has returned its exit code, the three are ignored: the process is only exiting, its
result printed, and a signal then changes nothing (Python's exit would hand SIGTERM back to its default
action: exit -15 and no line). The first of these signals raises Interrupted (a KeyboardInterrupt
carrying `signum`) and sets all three to be ignored: shutting down (closing a capture as 'interrupted') cannot be
interrupted again, however often the key is pressed. SIGKILL or SIGQUIT still stop it at once.
A dependency missing from this python (kvscope installed with --no-deps in an engine's venv, as the
probe needs: docs/probe.md) ends any verb with one line, exit 2: which module is missing and which kvscope
to run instead; `instrument` needs none of them (it finds its recorder's python: app/instrument.py).
Imports nothing from kvscope at module level: `kvscope` itself holds only the version.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; the exit code is 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, _frame: FrameType | None) -> None:
    for each in STOP_SIGNALS:
        signal.signal(each, signal.SIG_IGN)
    raise Interrupted(signum)


def ignore_stop_signals() -> None:
    """Once the verb has its exit code, what is left is the interpreter's exit: a stop signal then changes
    nothing. NOTE: Python's exit puts a handler it installed back to the default action, so a SIGTERM
    there killed the process (exit -15, no line) or raised in an atexit hook (a traceback); SIG_IGN stays."""
    for each in STOP_SIGNALS:
        signal.signal(each, signal.SIG_IGN)


def install_stop_handlers() -> None:
    """SIGINT, SIGTERM and SIGHUP raise Interrupted once, then are ignored."""
    for each in STOP_SIGNALS:
        if signal.getsignal(each) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            signal.signal(each, _stop)


def verb_of(argv: Sequence[str]) -> str:
    """The verb before argparse has run: the first argument that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), "")


def missing_line(verb: str, module: str) -> str:
    """One line for a dependency this python lacks."""
    return (
        f"kvscope{f' {verb}' if verb else ''}: error: {module} is not installed in this python ({sys.executable}): "
        "kvscope is installed here without its dependencies (pip install --no-deps, as beside an engine); "
        "run the kvscope of a venv where it is installed with them (`kvscope instrument` runs from here)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        install_stop_handlers()
        from kvscope.app.cli import main as cli_main

        code = cli_main(args)
        ignore_stop_signals()
        return code
    except ModuleNotFoundError as err:
        top = (err.name or "").partition(".")[0]
        if not top or top == "kvscope":  # NOTE: kvscope's own module missing is a defect: its traceback
            raise
        print(missing_line(verb_of(args), top), file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # before the verb ran (cli.main reports the rest)
        signum = getattr(stop, "signum", signal.SIGINT)
        for each in STOP_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        verb = verb_of(args)
        print(f"kvscope{f' {verb}' if verb else ''}: interrupted", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
