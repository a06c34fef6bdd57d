"""Engine configuration: pools, cache, scheduler. Frozen and validated at construction;
an impossible config raises ValueError with one line saying what and why."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

CacheKind = Literal["radix", "chunk", "swa-radix", "none"]
CACHE_KINDS: tuple[str, ...] = ("radix", "chunk", "swa-radix", "none")


@dataclass(frozen=True)
class PoolConfig:
    """Capacities in tokens; the SWA pool is `swa_full_tokens_ratio` of the full one
    (docs/memory-semantics.md §5.6)."""

    kv_size_tokens: int = 8192
    page_size: int = 1
    swa_full_tokens_ratio: float = 0.8
    max_running_requests: int = 64
    max_context_len: int = 4096

    def __post_init__(self) -> None:
        ps = self.page_size
        if ps < 1 or ps & (ps - 1):
            raise ValueError(f"page size must be a power of two, got {ps}")
        if self.kv_size_tokens < 2 * ps:
            raise ValueError(f"KV capacity {self.kv_size_tokens} tokens is smaller than two pages of {ps}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"SWA/full token ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.max_running_requests < 1 or self.max_context_len < 2:
            raise ValueError("max running requests must be >= 1 and max context length >= 2")

    @property
    def full_size_tokens(self) -> int:
        return self.kv_size_tokens // self.page_size * self.page_size

    @property
    def swa_size_tokens(self) -> int:
        return int(self.full_size_tokens * self.swa_full_tokens_ratio) // self.page_size * self.page_size


@dataclass(frozen=True)
class CacheConfig:
    kind: CacheKind = "radix"
    eviction_policy: str = "lru"
    eviction_granularity: Literal["leaf", "page"] = "leaf"

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"cache kind must be one of {', '.join(CACHE_KINDS)}; got {self.kind!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """SGLang's scheduling knobs (docs/memory-semantics.md §9) with their defaults."""

    chunked_prefill_size: int | None = 512
    max_prefill_tokens: int = 16384
    schedule_conservativeness: float = 1.0
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    clip_max_new_tokens: int = 4096
    retract_decode_steps: int = 20
    swa_eviction_interval: int = 128
    snapshot_interval_steps: int = 50
    leak_check_raise: bool = False

    def __post_init__(self) -> None:
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked prefill size must be >= 1 (or None to disable), got {self.chunked_prefill_size}")
        if self.max_prefill_tokens < 1 or self.schedule_conservativeness <= 0:
            raise ValueError("max prefill tokens must be >= 1 and schedule conservativeness > 0")

    @property
    def init_new_token_ratio(self) -> float:
        return min(0.7 * self.schedule_conservativeness, 1.0)

    @property
    def min_new_token_ratio(self) -> float:
        return self.init_new_token_ratio * self.min_new_token_ratio_factor

    @property
    def new_token_ratio_decay(self) -> float:
        return (self.init_new_token_ratio - self.min_new_token_ratio) / self.new_token_ratio_decay_steps


@dataclass(frozen=True)
class EngineConfig:
    pool: PoolConfig = field(default_factory=PoolConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"
    strict: bool = False

    def check_model(self, sliding_window: int | None, is_hybrid: bool) -> None:
        """Cross-checks between the engine and the model it runs."""
        if sliding_window is not None and sliding_window >= self.pool.max_context_len:
            raise ValueError(
                f"sliding window {sliding_window} is not smaller than the context length {self.pool.max_context_len}"
            )
        if self.cache.kind == "swa-radix" and not is_hybrid:
            raise ValueError("the swa-radix cache needs a hybrid sliding-window model (e.g. --model tiny-swa)")
        if is_hybrid and self.cache.kind == "radix":
            raise ValueError("a hybrid sliding-window model needs --cache swa-radix, chunk or none, not radix")
        window_and_page = (sliding_window or 0) + self.pool.page_size
        if is_hybrid and window_and_page >= self.pool.swa_size_tokens:
            raise ValueError(
                f"the SWA pool ({self.pool.swa_size_tokens} tokens) must exceed window + page size "
                f"({window_and_page})"
            )

    def fingerprint(self) -> dict[str, Any]:
        return asdict(self)
