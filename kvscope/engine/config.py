"""Engine configuration: pools, cache, scheduler. Frozen and validated at construction;
an impossible config raises ValueError with one line saying what and why.
`EngineConfig.check_model` adds what needs the model and the machine (the device exists, the
pools fit its memory); the engine and `kvscope run` call it before anything is allocated.

NOTE: the bytes the pools take (build_memory in memory.py), F = full-pool tokens, S = SWA-pool
tokens, P = page size, R = max running requests, L = max context length, B = K+V bytes of one
token in one layer:
    KV buffers       (F + P) x B x full layers + (S + P) x B x SWA layers    (padding page included)
    req_to_token     (R + 1) x L x 4 (int32) + (R + 1) x 8 (row generations)
    free lists       (F / P + S / P) x 8 (int64 page ids) + (F + P + 1) x 8 (hybrid: full->SWA map)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from kvscope.engine.cache_kinds import CacheKind, cache_kind, check_fits_model

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
HOST_SETTINGS = ("write_policy", "host_ratio", "host_tokens")  # the hiradix cache's (CacheConfig)
SchedulePolicy = Literal["fcfs", "lpm"]
SCHEDULE_POLICIES: tuple[str, ...] = ("fcfs", "lpm")
INDEX_BYTES = 8  # an int64 page id or slot index
SLOT_BYTES = 4  # an int32 slot in req_to_token


class KVLayout(Protocol):
    """What the memory check needs of a model (ModelConfig has it)."""

    @property
    def full_layer_ids(self) -> tuple[int, ...]: ...

    @property
    def swa_layer_ids(self) -> tuple[int, ...]: ...

    @property
    def kv_bytes_per_layer_token(self) -> int: ...


class PoolBytes(NamedTuple):
    kv_bytes: int | None  # K/V buffers of every layer; None: not counted (no model given)
    req_to_token_bytes: int
    free_list_bytes: int  # the allocators' page lists and the SWA slot map

    @property
    def total_bytes(self) -> int:
        return (self.kv_bytes or 0) + self.req_to_token_bytes + self.free_list_bytes

    def describe(self) -> str:
        kv = "" if self.kv_bytes is None else f"KV buffers {format_bytes(self.kv_bytes)}, "
        rows, lists = format_bytes(self.req_to_token_bytes), format_bytes(self.free_list_bytes)
        return f"{kv}req_to_token {rows}, free lists {lists}"


def format_bytes(num_bytes: float) -> str:
    """1.50 GiB, 3.64 TiB, 512 B."""
    if num_bytes < 1024:
        return f"{num_bytes:.0f} B"
    exponent = min(int(math.log(num_bytes, 1024)), 6)
    return f"{num_bytes / 1024**exponent:,.2f} {'BKMGTPE'[exponent]}iB"


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

    def pool_bytes(self, is_hybrid: bool, kv: KVLayout | None = None) -> PoolBytes:
        """The bytes the pools take (the module note); KV buffers count only when `kv` is given."""
        ps, full = self.page_size, self.full_size_tokens
        swa = self.swa_size_tokens if is_hybrid else 0
        kv_bytes = None
        if kv is not None:
            full_layers, swa_layers = len(kv.full_layer_ids), len(kv.swa_layer_ids)
            kv_bytes = ((full + ps) * full_layers + (swa + ps) * swa_layers) * kv.kv_bytes_per_layer_token
        rows = self.max_running_requests + 1
        free_lists = (full // ps + swa // ps) * INDEX_BYTES + ((full + ps + 1) * INDEX_BYTES if is_hybrid else 0)
        return PoolBytes(kv_bytes, rows * self.max_context_len * SLOT_BYTES + rows * INDEX_BYTES, free_lists)


@dataclass(frozen=True)
class CacheConfig:
    """The prefix cache. promote_k .. merge_chains are the scoped-radix cache's (tenant isolation,
    docs/isolation.md): promote_k None never promotes (per-principal isolation); epoch_s
    is the length of one epoch of the promotion window; pinned are operator-declared public
    prefixes as token ids; dedup lets a principal's recomputed copy of a node it cannot see share
    that node's KV; merge_chains merges private unary chains. write_policy .. host_tokens are the
    hiradix cache's (docs/memory-semantics.md §2.8, §7): the host pool holds host_tokens, or
    host_ratio x the device pool when None."""

    kind: CacheKind = "radix"
    eviction_policy: str = "lru"
    eviction_granularity: Literal["leaf", "page"] = "leaf"
    promote_k: int | None = 3
    epoch_s: float = 60.0
    pinned: tuple[tuple[int, ...], ...] = ()
    dedup: bool = False
    merge_chains: bool = False
    write_policy: WritePolicy = "write_through"
    host_ratio: float = 2.0
    host_tokens: int | None = None

    def __post_init__(self) -> None:
        cache_kind(self.kind)  # ValueError naming the kinds
        if self.promote_k is not None and (type(self.promote_k) is not int or self.promote_k < 1):
            raise ValueError(f"promote_k must be an int >= 1, or None for never; got {self.promote_k!r}")
        if (
            isinstance(self.epoch_s, bool)
            or not isinstance(self.epoch_s, int | float)
            or not math.isfinite(self.epoch_s)
            or self.epoch_s <= 0
        ):
            raise ValueError(f"epoch_s must be a finite number of seconds > 0, got {self.epoch_s!r}")
        if any(not prefix for prefix in self.pinned):
            raise ValueError("a pinned prefix must hold at least one token")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {', '.join(WRITE_POLICIES)}; got {self.write_policy!r}")
        if (
            isinstance(self.host_ratio, bool)
            or not isinstance(self.host_ratio, int | float)
            or not math.isfinite(self.host_ratio)
            or self.host_ratio <= 0
        ):
            raise ValueError(f"host ratio must be a finite number > 0, got {self.host_ratio!r}")
        if self.host_tokens is not None and (type(self.host_tokens) is not int or self.host_tokens < 1):
            raise ValueError(f"host tokens must be an int >= 1, or None for the ratio; got {self.host_tokens!r}")


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
    schedule_policy: SchedulePolicy = "fcfs"  # lpm: longest visible cached prefix first (§9.2)

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule policy must be one of {', '.join(SCHEDULE_POLICIES)}; got {self.schedule_policy!r}"
            )
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
    torch_threads: int | None = None  # torch's intra-op threads in the engine's process; None: torch's own default

    def check_model(self, sliding_window: int | None, is_hybrid: bool, kv: KVLayout | None = None) -> None:
        """Cross-checks between the engine, the model it runs and the machine: the cache and the
        window fit the model, the eviction policy exists, the device is there, and the pools
        fit in the memory it has free (KV buffers counted when `kv`, the model, is given)."""
        self._check_window(sliding_window, is_hybrid)
        from kvscope.cache import get_policy  # NOTE: loads torch; the configs themselves do not

        get_policy(self.cache.eviction_policy)  # CacheMisuseError (a ValueError) names the valid ones
        self.check_memory(is_hybrid, kv)

    def check_memory(self, is_hybrid: bool, kv: KVLayout | None = None) -> None:
        """ValueError naming both numbers when the pools need more than the device has free."""
        from kvscope.mem import available_memory_bytes, resolve_device

        device = resolve_device(self.device)
        available = available_memory_bytes(device)
        need = self.pool.pool_bytes(is_hybrid, kv)
        if available is not None and need.total_bytes > available:
            raise ValueError(
                f"the pools need {format_bytes(need.total_bytes)} ({need.describe()}) but {device} has "
                f"{format_bytes(available)} available; lower --kv-tokens, --max-running-requests or --max-context-len"
            )

    def _check_window(self, sliding_window: int | None, is_hybrid: bool) -> None:
        if sliding_window is not None and sliding_window >= self.pool.max_context_len:
            raise ValueError(
                f"sliding window {sliding_window} is not smaller than the context length {self.pool.max_context_len}"
            )
        check_fits_model(self.cache.kind, is_hybrid)
        window_and_page = (sliding_window or 0) + self.pool.page_size
        if is_hybrid and window_and_page >= self.pool.swa_size_tokens:
            raise ValueError(
                f"the SWA pool ({self.pool.swa_size_tokens} tokens) must exceed window + page size ({window_and_page})"
            )

    def fingerprint(self) -> dict[str, Any]:
        """The config as a dict; the host tier's settings only where the cache has one."""
        config = asdict(self)
        if not cache_kind(self.cache.kind).has_host:
            for name in HOST_SETTINGS:
                del config["cache"][name]
        return config
