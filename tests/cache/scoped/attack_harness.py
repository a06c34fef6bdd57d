"""A prompt-stealing attacker against a prefix cache, in process (docs/isolation.md, "Security
property, and its honest limit": the hit oracle and the sybil bound).

The victim sends a public prefix P plus secret digits, one token each. The attacker reads
only what an API returns, `cached_tokens`, and walks the secret token by token: for position
i it sends P + recovered + [d, FILLER] for each digit d; the guess was right when more tokens
come back cached than it could have hit on its own.

NOTE: why the FILLER token. The engine matches a prompt without its last token (that token's
logits must be computed), so a probe that ended at the guess could never show the guess hit.
NOTE: the attacker's own copies. Every probe is a request, so its tokens are cached for the
attacker itself; a later probe that shares them hits the attacker's own copy. `Attacker.own_len`
is the longest prefix a prompt shares with anything the attacker sent before (what it could
hit on its own); only cached tokens beyond that are evidence about someone else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvscope.cache import BasePrefixCache, EvictParams, RadixCache, ScopedRadixCache
from kvscope.mem import make_token_allocator

DIGITS = tuple(range(100, 110))  # the secret's alphabet: 10 token ids
FILLER = 7
PUBLIC_PREFIX = tuple(range(300, 332))  # P: 32 tokens everyone sends (ids below the tiny model's vocabulary, 512)
SECRET_LEN = 6
EPOCH_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Target(Protocol):
    def serve(self, prompt: Sequence[int], user: str) -> int:
        """Serve `prompt` for `user`; the cached tokens the server reports."""
        ...


class Server:
    """One cache on a real CPU allocator, serving one request at a time as the engine does."""

    def __init__(self, make_cache: Callable[..., BasePrefixCache], size: int = 1 << 13) -> None:
        self.clock = FakeClock()
        self.allocator = make_token_allocator(size, 1, "cpu")
        self.cache = make_cache(self.allocator, self.clock)
        self.num_prefills = 0  # requests served (each one a prefill)

    def serve(self, prompt: Sequence[int], user: str) -> int:
        """Serve `prompt` for `user`; the cached tokens the server reports (the visible match).

        NOTE: match (without the last token) -> lock -> allocate [prefix_len, len) -> insert
        everything -> free the duplicates [prefix_len, inserted_prefix) -> unlock."""
        ids = np.asarray(prompt, dtype=np.int32)
        match = self.cache.match_prefix(ids[:-1], user=user)
        prefix_len = match.prefix_len
        self.cache.inc_lock_ref(match.last_node)
        need = len(ids) - prefix_len
        if need > self.allocator.available_size():
            self.cache.evict(EvictParams(min(need, self.cache.evictable_size())))
        new = self.allocator.alloc(need)
        assert new is not None, f"no room for {need} tokens"
        slots = torch.cat((match.device_indices, new))
        inserted_prefix = self.cache.insert(ids, slots, user=user)
        self.allocator.free(slots[prefix_len:inserted_prefix])
        self.cache.dec_lock_ref(match.last_node)
        self.cache.check_integrity()
        in_tree = self.cache.evictable_size() + self.cache.protected_size()
        assert self.allocator.available_size() + in_tree == self.allocator.total_size  # no slot leaked
        self.num_prefills += 1
        return prefix_len

    @property
    def scoped(self) -> ScopedRadixCache:
        assert isinstance(self.cache, ScopedRadixCache)
        return self.cache

    def next_epoch(self) -> None:
        self.clock.now_s += EPOCH_S

    def flush(self) -> None:
        """Memory pressure: evict every unlocked node (no request is running between calls)."""
        self.cache.evict(EvictParams(self.cache.evictable_size()))
        self.cache.check_integrity()
        assert self.cache.evictable_size() + self.cache.protected_size() == 0


def global_cache() -> Server:
    """Global sharing (RadixCache): every principal sees every node."""
    return Server(lambda allocator, clock: RadixCache(allocator, 1))


def scoped_cache(promote_k: int | None, dedup: bool = False) -> Server:
    """The scoped cache with P pinned (public for everyone), on a fake clock."""
    return Server(
        lambda allocator, clock: ScopedRadixCache(
            allocator,
            1,
            promote_k=promote_k,
            epoch_s=EPOCH_S,
            pinned=[PUBLIC_PREFIX],
            dedup=dedup,
            clock=clock,
            strict=True,
        )
    )


@dataclass
class Attacker:
    """One account: it remembers every prompt it sent (its own cache footprint)."""

    server: Target
    user: str
    tracks_own: bool = True  # False: a naive attacker that reads its own copies as hits
    sent: list[tuple[int, ...]] = field(default_factory=list)
    cached_from: int = 0  # sent[cached_from:] may still be cached for it

    def own_len(self, prompt: Sequence[int]) -> int:
        """The longest prefix of `prompt[:-1]` it shares with a prompt this account sent (since
        its copies were last evicted)."""
        head = tuple(prompt[:-1])
        return max((_common_len(head, s) for s in self.sent[self.cached_from :]), default=0)

    def forget(self) -> None:
        """Its copies were evicted (an attacker learns that by flooding the pool, or by re-sending
        one of its own prompts and seeing it miss)."""
        self.cached_from = len(self.sent)

    def send(self, prompt: Sequence[int]) -> int:
        cached = self.server.serve(prompt, self.user)
        self.sent.append(tuple(prompt))
        return cached


def probe(prefix: Sequence[int], digit: int) -> tuple[int, ...]:
    return (*prefix, digit, FILLER)


def try_digit(attacker: Attacker, prefix: Sequence[int], digit: int) -> bool:
    """Send the probe for `digit` after `prefix`; whether it hit tokens someone else computed
    through the digit: the match covers prefix + [digit], and (unless the attacker is naive)
    the attacker never sent that itself."""
    prompt = probe(prefix, digit)
    through = len(prefix) + 1
    own = attacker.own_len(prompt) if attacker.tracks_own else 0
    cached = attacker.send(prompt)
    return own < through <= cached


def search_position(
    attacker: Attacker, prefix: Sequence[int], between: Callable[[], None] = lambda: None
) -> int | None:
    """Try every digit after `prefix` (calling `between` after each probe); the first that hit."""
    for digit in DIGITS:
        hit = try_digit(attacker, prefix, digit)
        between()
        if hit:
            return digit
    return None


def recover(attacker: Attacker, between: Callable[[], None] = lambda: None) -> tuple[int, ...]:
    """The token-by-token search: the digits recovered in order, up to the first position that failed."""
    recovered: list[int] = []
    while len(recovered) < SECRET_LEN:
        digit = search_position(attacker, (*PUBLIC_PREFIX, *recovered), between)
        if digit is None:
            break
        recovered.append(digit)
    return tuple(recovered)


def num_correct(recovered: Sequence[int], secret: Sequence[int]) -> int:
    """Secret digits recovered: the length of the correct leading run."""
    return _common_len(recovered, secret)


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
