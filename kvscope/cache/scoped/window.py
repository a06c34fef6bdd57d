"""Two-bucket epoch windows (the current epoch and the previous one) of per-principal counts,
rolled over when touched, with no background thread.

NOTE: rollover at epoch E of a window last touched at epoch e:
    e == E        nothing
    e == E - 1    previous <- current; current <- empty
    e <  E - 1    previous <- empty;   current <- empty (idle for two epochs or more)
"In the window" means the current and the previous epoch, so its effective length lies
between W and 2W seconds. Reads never roll a window over (they compute what a rollover
would leave), so reading has no side effect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NO_EPOCH = -(2**62)


def epoch_of(now_s: float, start_s: float, epoch_s: float) -> int:
    """E = floor((now - t0) / W)."""
    return int((now_s - start_s) // epoch_s)


@dataclass(slots=True)
class Window:
    """Per-principal counts in the current and the previous epoch; at most `cap` principals a
    bucket (the first one counted is dropped first), so memory stays bounded."""

    epoch: int = NO_EPOCH
    current: dict[str, int] = field(default_factory=dict)
    previous: dict[str, int] = field(default_factory=dict)

    def roll(self, epoch: int) -> None:
        if self.epoch == epoch:
            return
        if self.epoch == epoch - 1:
            self.previous, self.current = self.current, {}
        else:
            self.previous, self.current = {}, {}
        self.epoch = epoch

    def add(self, epoch: int, principal: str, cap: int) -> None:
        self.roll(epoch)
        if principal not in self.current and len(self.current) >= cap:
            del self.current[next(iter(self.current))]
        self.current[principal] = self.current.get(principal, 0) + 1

    def buckets(self, epoch: int) -> tuple[dict[str, int], dict[str, int]]:
        """(current, previous) as they would read at `epoch`, without rolling over."""
        if self.epoch == epoch:
            return self.current, self.previous
        if self.epoch == epoch - 1:
            return {}, self.current
        return {}, {}

    def principals(self, epoch: int) -> set[str]:
        """The distinct principals in the window (the union of both buckets, not the sum)."""
        current, previous = self.buckets(epoch)
        return set(current) | set(previous)

    def counts(self, epoch: int) -> tuple[int, int]:
        """(hits in the current epoch, hits in the previous one)."""
        current, previous = self.buckets(epoch)
        return sum(current.values()), sum(previous.values())

    def copy(self) -> Window:
        """An independent copy (split halves copy their counters; they never share them)."""
        return Window(self.epoch, dict(self.current), dict(self.previous))

    def stale(self, epoch: int) -> bool:
        return self.epoch < epoch - 1
