"""The KV-less shadow content trie: who computed which token prefixes, in the epoch window.

Promotion counts *creators* (principals that paid the prefill for a prefix themselves), not
hitters: a principal can never hit another's private node, so "distinct users who used it" can
only mean users who computed it. With dedup off, each principal's copy lives in its own
namespace, so counting needs one place keyed by content alone: here, a map from a prefix's
chain hash to the window of its creators. It holds no KV and no matching ever reads it.

NOTE: a prefix of j whole pages is named by chain(j) = blake2b(chain(j - 1) + page j), 16
bytes; chain(0) = ROOT_HASH. A collision would need a blake2b-128 collision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from kvscope.cache.scoped.window import Window

ROOT_HASH = bytes(16)
CREATORS_CAP = 64  # principals a window bucket keeps: far above any promotion threshold in use


def chain_hashes(parent_hash: bytes, key: bytes, page_bytes: int) -> list[bytes]:
    """The chain hash at the end of each whole page of `key`, starting from `parent_hash`."""
    out = []
    h = parent_hash
    for pos in range(0, len(key) - len(key) % page_bytes, page_bytes):
        h = hashlib.blake2b(h + key[pos : pos + page_bytes], digest_size=16).digest()
        out.append(h)
    return out


class CreatorLedger:
    def __init__(self) -> None:
        self.windows: dict[bytes, Window] = {}

    def record(self, hashes: Iterable[bytes], principal: str, epoch: int) -> None:
        """`principal` computed every prefix named in `hashes` at `epoch`."""
        for h in hashes:
            window = self.windows.get(h)
            if window is None:
                window = self.windows[h] = Window()
            window.add(epoch, principal, CREATORS_CAP)

    def creators(self, prefix_hash: bytes, epoch: int) -> set[str]:
        window = self.windows.get(prefix_hash)
        return window.principals(epoch) if window is not None else set()

    def prune(self, epoch: int) -> None:
        """Forget windows that no longer count (idle for two epochs or more)."""
        self.windows = {h: w for h, w in self.windows.items() if not w.stale(epoch)}

    def __len__(self) -> int:
        return len(self.windows)
