"""`make install`'s phase printer: runs one install command and keeps the terminal alive.

    python scripts/show_progress.py [--tick-s S] -- COMMAND [ARG ...]

Shows the lines of COMMAND's stdout that say what pip is doing (Collecting, Processing,
Downloading, Installing collected packages, Successfully installed), indented; hides the
rest (a second install's "Requirement already satisfied" lines). While nothing is shown, a
ticking line says how long the step has run: rewritten in place on a terminal, one line per
tick otherwise (a log stays readable). COMMAND's stderr passes through untouched, so pip's
errors show as pip writes them. Exits with COMMAND's exit code. Standard library only: it
runs before the virtual environment has anything installed.
"""

from __future__ import annotations

import argparse
import queue
import re
import subprocess
import sys
import threading
import time
from typing import IO

SHOWN = re.compile(r"^\s*(Collecting|Processing|Downloading|Installing collected packages|Successfully installed)\b")
INDENT = "    "
MAX_LINE_CHARS = 116  # NOTE: "Installing collected packages: ..." names every package on one line
TERMINAL_TICK_S = 1.0


def shown(line: str) -> str | None:
    """The line as printed (indented, cut to MAX_LINE_CHARS), or None when it is hidden."""
    if not SHOWN.match(line):
        return None
    line = line.rstrip()
    return INDENT + (line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 1] + "…")


def tick_text(elapsed_s: float) -> str:
    return f"{INDENT}… still working, {elapsed_s:.0f} s so far"


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run(command: list[str], tick_s: float, out: IO[str]) -> int:
    """Run `command`, printing its shown lines and ticks to `out`; its exit code."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert process.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
    in_place = out.isatty()
    interval_s = TERMINAL_TICK_S if in_place else tick_s
    started = last_shown = time.monotonic()
    ticking = False  # NOTE: on a terminal, whether the cursor sits at the end of a tick line
    while True:
        try:
            line = lines.get(timeout=interval_s)
        except queue.Empty:
            now = time.monotonic()
            if in_place:
                out.write(f"\r{tick_text(now - started)}\x1b[K")
                ticking = True
            elif now - last_shown >= tick_s:
                out.write(tick_text(now - started) + "\n")
                last_shown = now
            out.flush()
            continue
        if line is None:
            break
        text = shown(line)
        if text is not None:
            out.write(("\r\x1b[K" if ticking else "") + text + "\n")
            out.flush()
            ticking, last_shown = False, time.monotonic()
    if ticking:
        out.write("\r\x1b[K")
        out.flush()
    return process.wait()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tick-s", type=float, default=15.0, help="seconds of silence between ticks in a log")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    return run(command, args.tick_s, sys.stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
