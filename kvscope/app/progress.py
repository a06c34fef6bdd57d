"""The one progress line of every verb: a status line on stderr, redrawn in place.

Lower layers never print progress; they call a plain hook they are given (the engine's
`progress(stats, submitted)`, the replays' `on_done(done, total)`, the ledger replay's
`on_progress(events)`). The verb's hook asks `due()` and, only then, formats its text and
`draw()`s it, so a hook that is not due costs a clock read.

NOTE: nothing is drawn unless `out` is a terminal, so captured output (tests, pipes, CI logs)
never holds a progress line; `close()` ends the line only if something was drawn.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """`[#########.....................]`: done of total, in `width` cells."""
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}]"


class Progress:
    """A line on `out` redrawn at most every `interval_s`, first after `delay_s` (both seconds)."""

    def __init__(self, out: TextIO | None = None, *, delay_s: float = 0.0, interval_s: float = 0.0) -> None:
        out = sys.stderr if out is None else out
        self.out = out
        self.live = out.isatty()
        self.delay_s = delay_s
        self.interval_s = interval_s
        self.started = time.monotonic()
        self.last_drawn: float | None = None
        self.drawn = False

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def due(self) -> bool:
        """Whether a draw now would show: on a terminal, past the delay and the interval."""
        if not self.live:
            return False
        now = time.monotonic()
        if now - self.started < self.delay_s:
            return False
        return self.last_drawn is None or now - self.last_drawn >= self.interval_s

    def draw(self, text: str) -> None:
        self.out.write(f"\r{text}")
        self.out.flush()
        self.last_drawn = time.monotonic()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.out.write("\n")
