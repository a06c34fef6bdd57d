"""What an attached capture holds (`kvscope attach`: a real engine watched from outside): its
source's details, the attach loop's counters, and reads of the engine's own figures (NULL where
it exports nothing). What a source cannot show is kvscope.telemetry.capabilities'. Pure
functions: no Streamlit.

NOTE: an attached run's config carries "source": {"kind": "attach", "engine", "version", "url",
"model", "block_size", "capacity_tokens", "kv_events", "warnings", "provides"}; an engine run has
no "source" key. `provides` lists what the source gives, from PROVIDED below. Its usage rows hold
the engine's /metrics scrapes, one per tick: a column the engine does not export is NULL (schema
version 5 and up; full_used since 5). Its events are the page forest's changes (a page per node,
no slots, no requests, no locks), and its final `reports` row of kind "attach" holds the attach
loop's counters.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

# what a source may provide (runs.config["source"]["provides"])
PROVIDED = ("pages", "usage.split", "usage.used", "hit_rate", "evictions", "host_tier", "requests.counts")
COUNTERS = ("delivered", "lost_batches", "gaps", "restarts", "bad_messages", "unknown_removes", "orphans", "resets")
COUNTER_HELP = {
    "delivered": "event batches received and applied to the page forest",
    "lost_batches": "batches the engine published that never arrived (sequence gaps the replay could not fill)",
    "gaps": "sequence gaps seen on the event stream",
    "restarts": "times the engine's sequence started over (an engine restart: the forest was rebuilt)",
    "bad_messages": "messages that were not a batch of KV events (skipped, each named in the attach log)",
    "unknown_removes": "removes of pages the forest never saw stored (stored before kvscope attached)",
    "orphans": "pages whose parent page was unknown when they were stored (an unknown prefix)",
    "resets": "times the engine cleared its whole cache (an AllBlocksCleared event)",
}

VERDICT_TITLE = "Not known: an attached engine runs its own leak check"
VERDICT_LINE = (
    "kvscope watched this engine from outside (its KV events and /metrics), so it cannot balance the "
    "engine's pool. `kvscope report engine-log FILE` finds and explains the leak messages in its "
    "server log."
)


@dataclass(frozen=True)
class Source:
    engine: str
    version: str | None
    url: str | None
    model: str | None
    block_size: int | None
    capacity_tokens: int | None
    warnings: tuple[str, ...]
    provides: frozenset[str]

    def gives(self, what: str) -> bool:
        return what in self.provides

    @property
    def title(self) -> str:
        """e.g. "vllm 0.32.0 at http://127.0.0.1:8000"."""
        version = f" {self.version}" if self.version else " (version unknown)"
        return f"{self.engine}{version}" + (f" at {self.url}" if self.url else "")


COUNTER_ENGINES = ("sglang", "kvscope")  # NOTE: export sglang:evicted_tokens_total; vLLM exports no such counter


def evicted_label(engine: str, has_pages: bool) -> tuple[str, str]:
    """The evicted-tokens metric's label and help, named by where the number comes from: the
    engine's own counter, or (vLLM) the pages its KV event stream removed from the device."""
    if engine in COUNTER_ENGINES:
        return "evicted tokens (engine counter)", "sglang:evicted_tokens_total, the engine's own count"
    if has_pages:
        return (
            "evicted tokens (from KV events)",
            f"{engine} exports no eviction counter: the tokens of the "
            "pages its KV event stream removed from the device since kvscope attached",
        )
    return "evicted tokens", f"{engine} exports no eviction counter, and its KV events were not subscribed"


def run_config(run: Any) -> dict[str, Any]:
    try:
        config = json.loads(run.config or "{}")
    except (AttributeError, TypeError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def source_of(run: Any) -> Source | None:
    """The attached source of a runs() row; None for an engine run."""
    raw = run_config(run).get("source")
    if not isinstance(raw, dict) or raw.get("kind") != "attach":
        return None
    warnings = raw.get("warnings") or []
    provides = raw.get("provides") or []
    return Source(
        engine=str(raw.get("engine") or "unknown engine"),
        version=_text(raw.get("version")),
        url=_text(raw.get("url")),
        model=_text(raw.get("model")),
        block_size=_int(raw.get("block_size")),
        capacity_tokens=_int(raw.get("capacity_tokens")),
        warnings=tuple(str(w) for w in warnings) if isinstance(warnings, list) else (),
        provides=frozenset(str(p) for p in provides) if isinstance(provides, list) else frozenset(),
    )


def counters_of(body: str | None) -> dict[str, int] | None:
    """The attach loop's counters from its report body (JSON); None when absent or unreadable."""
    if not body:
        return None
    try:
        raw = json.loads(body)
    except (TypeError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    return {name: int(raw[name]) for name in COUNTERS if isinstance(raw.get(name), int | float)}


def value(row: pd.Series | dict[str, Any], column: str) -> int | None:
    """A usage cell as an int; None when the column is absent or NULL (not provided)."""
    raw = row.get(column) if hasattr(row, "get") else None
    return _int(raw)


def used_tokens(row: pd.Series | dict[str, Any]) -> int | None:
    """Device tokens in use: the engine's own figure (full_used) when recorded, else total -
    available - evictable when the source splits its pool; None when neither is known."""
    used = value(row, "full_used")
    if used is not None:
        return used
    total, available, evictable = (value(row, f"full_{c}") for c in ("total", "available", "evictable"))
    if total is None or available is None or evictable is None:
        return None
    return total - available - evictable


def used_series(usage: pd.DataFrame) -> pd.Series:
    """used_tokens per usage row (NaN where unknown)."""
    return pd.Series(
        [float("nan") if (u := used_tokens(r)) is None else float(u) for _, r in usage.iterrows()],
        index=usage.index,
        dtype=float,
    )


@dataclass(frozen=True)
class TokenHitRate:
    """cached / prompt tokens as the engine's counters give them (a ratio of sums)."""

    hit_tokens: int
    prompt_tokens: int

    @property
    def rate(self) -> float | None:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens > 0 else None


def hit_rate(last: pd.Series | dict[str, Any], first: pd.Series | dict[str, Any] | None = None) -> TokenHitRate | None:
    """The token hit rate of the engine's counters at `last` (since the engine started), or over
    the span from `first` to `last` when `first` is given; None when the counters are absent, or
    when they went backwards in the span (the engine restarted)."""
    hits, prompts = value(last, "cum_hit_tokens"), value(last, "cum_prompt_tokens")
    if hits is None or prompts is None:
        return None
    if first is not None:
        hits0, prompts0 = value(first, "cum_hit_tokens"), value(first, "cum_prompt_tokens")
        if hits0 is None or prompts0 is None or hits0 > hits or prompts0 > prompts:
            return None
        hits, prompts = hits - hits0, prompts - prompts0
    return TokenHitRate(hits, prompts)


def tiers_of(tier: Any) -> set[str]:
    """The tiers a snapshot row's tier names ("device", "device+host", "host+disk", ...; NULL
    reads as the device)."""
    return set(str(tier).split("+")) if isinstance(tier, str) and tier else {"device"}


def tier_category(tier: Any) -> str:
    """A page's tier as the tree colours it: on the device only, on the device with a copy on a
    slower tier (device+host), or only on slower tiers (host: the host, disk or external store)."""
    tiers = tiers_of(tier)
    if "device" not in tiers:
        return "host"
    return "device+host" if len(tiers) > 1 else "device"


def cached_tokens(nodes: pd.DataFrame) -> dict[str, int]:
    """Tokens of the pages in a tree snapshot on the device, and on the host tier."""
    if nodes.empty or "tier" not in nodes:
        return {"device": 0, "host": 0}
    tiers = [tiers_of(t) for t in nodes["tier"]]
    tokens = nodes["num_tokens"].fillna(0).astype(int).tolist()
    return {name: int(sum(n for n, on in zip(tokens, tiers, strict=True) if name in on)) for name in ("device", "host")}


def _int(raw: Any) -> int | None:
    if raw is None or isinstance(raw, bool):
        return None
    try:
        number = float(raw)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else int(number)


def _text(raw: Any) -> str | None:
    return str(raw) if raw not in (None, "") else None
