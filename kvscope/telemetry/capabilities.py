"""What a run's source can show, from the run's config: a page section renders when its
capability is provided and otherwise says in one line (`cannot_show`) what this source cannot
give. Pure (stdlib only): the dashboard, the debugger and the CLI may all read it.

NOTE: three kinds of source, told apart by the config's "source" key:
    engine   kvscope's own engine (`kvscope run` / `serve`): no "source" key. Slots, their owners,
             lock refs, the slot ledger, every request's times, tenants.
    attach   `kvscope attach` (a real engine watched from outside): "source": {"kind": "attach",
             "engine", "version", "provides": [...]}. What it gives is its `provides` list
             (ATTACH_PROVIDES maps those names to the capabilities here).
    probe    kvscope's probe inside a real engine (`kvscope instrument`): "source": {"kind":
             "probe", "engine": "vllm" | "sglang", "version", "provides": [...]}. Its pool with
             the request that took each part, its idle leak checks, its requests (PROBE_PROVIDES);
             per engine (PROBE_ENGINES) vLLM's ref-counted blocks and block census; its `provides`
             adds what a newer probe records (an SGLang probe's "locks", say); its `lacks` removes
             what its level left out (the SGLang probe at summary: "evictions").
A capability a config cannot promise (tree snapshots, request arrival times, a host tier in the
usage rows) is added from the data by the reader (`Capabilities.with_data`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

CAPABILITIES = {
    "slots": "the pool's token slots, each owned by one holder (kvscope's slot ledger)",
    "blocks": "the engine's ref-counted blocks, with the request that took or released each",
    "forest": "the engine's cached pages as a forest rebuilt from its KV events (no owner, no lock)",
    "usage.used": "the tokens in use, per step or scrape",
    "usage.split": "free and evictable (cached, unused) tokens apart, per step or scrape",
    "ownership": "which request holds which slot or block",
    "locks": "lock refs on tree nodes (protected tokens, lock holders)",
    "refs": "each block's ref count (the requests that share it)",
    "leak_checks": "idle leak checks that kvscope judges (clean / leak / inconclusive)",
    "ledger": "the slot ledger replayed from the events: culprits, onset, locks never released",
    "census": "the probe's idle block census: its terms, and the request that last took a leaked block",
    "requests": "a record per request (prompt, cached tokens, finish)",
    "latencies": "each request's arrival, admission and first-token times",
    "in_flight": "each request's arrive and admit events as they happen (the requests not yet ended)",
    "request_counts": "running and waiting requests, per step or scrape",
    "hit_rate": "the prefix cache's hit and query counters",
    "tree": "the cache tree at any step (events replayed from snapshots)",
    "tree_snapshots": "stored snapshots of the cache tree",
    "evictions": "evict events with their reasons",
    "regret": "which node each prefix match stopped at (an eviction's age, idle time and regret)",
    "tiers": "a host tier beside the device",
    "swa": "the sliding-window (SWA) pool beside the full one",
    "waste": "each running request's length (the unused tail of its last page)",
    "tenants": "the principal behind each request",
    "request_stream": "the prompts' tokens (the hit-rate vs capacity curve)",
    "gpu": "the GPU of the machine that recorded the run (this machine)",
    "attach_loop": "the attach loop's counters (event batches delivered and lost, gaps, restarts ...)",
}

ENGINE_PROVIDES = frozenset(
    {
        "slots",
        "usage.used",
        "usage.split",
        "ownership",
        "locks",
        "leak_checks",
        "ledger",
        "requests",
        "latencies",
        "request_counts",
        "hit_rate",
        "tree",
        "evictions",
        "regret",
        "waste",
        "tenants",
        "request_stream",
        "gpu",
        "swa",
        "tiers",  # NOTE: the engine records them wherever its cache has them (the pages say when it has not)
    }
)
PROBE_PROVIDES = frozenset(
    {  # NOTE: every probe; its unit is pages unless it says blocks (or slots)
        "usage.used",
        "ownership",
        "leak_checks",
        "requests",
        "request_counts",
        "hit_rate",
        "tree",
        "evictions",
    }
)
PROBE_ENGINES = {  # NOTE: what a probe of one engine provides beyond the common set
    "vllm": frozenset({"blocks", "refs", "census"}),  # ref-counted blocks; the block census as its leak checks
}
ATTACH_PROVIDES = {  # NOTE: `kvscope attach`'s names (attached.PROVIDED) -> capabilities
    "pages": ("forest", "evictions"),
    "usage.split": ("usage.split",),
    "usage.used": ("usage.used",),
    "hit_rate": ("hit_rate",),
    "evictions": ("evictions",),
    "host_tier": ("tiers",),
    "requests.counts": ("request_counts",),
}
PROBE_EXTRA = frozenset(CAPABILITIES) - {"forest", "attach_loop"}  # a probe's `provides` may name more (a newer one)

# NOTE: one line per capability a source lacks; {engine} is the source's engine, {unit} what its pool is
# made of (slots, blocks, pages). A line per kind of
# source where the reason differs; "*" otherwise.
CANNOT_SHOW: dict[str, dict[str, str]] = {
    "slots": {
        "attach": "Per-slot ownership: not provided. An attached engine's KV events name cached pages, not the token "
        "slots of its pool, so kvscope cannot say which slot belongs to what.",
        "*": "Per-slot ownership: not provided. This capture follows {engine}'s {unit} and the requests that take "
        "them, not single token slots.",
    },
    "locks": {
        "attach": "Lock refs: not provided. The events say which pages are cached, not which running request pins "
        "them, so protected (locked) tokens and lock_ref colouring are unavailable.",
        "*": "Lock refs: not provided. {engine}'s blocks carry ref counts, not tree locks, so protected tokens are "
        "not split out (the Radix tree page shows each block's ref count and holders).",
    },
    "ownership": {
        "*": "Which request holds what: not provided. The events name no request, and the engine's own request "
        "records stay inside it.",
    },
    "swa": {
        "attach": "SWA-window occupancy: not provided. Only the engine's main attention group is followed (a "
        "sliding-window group's pages are not its prefixes).",
        "*": "SWA-window occupancy: not provided. This capture follows {engine}'s {unit} as one pool.",
    },
    "leak_checks": {
        "*": "Leak checks: not provided. An attached engine runs its own leak check, which kvscope cannot see; "
        "`kvscope report engine-log FILE` explains the leak messages in its server log.",
    },
    "ledger": {
        "*": "Slot-ledger culprits: not replayed. {engine}'s {unit} are not replayed through kvscope's slot ledger: "
        "the culprits are the ones its own leak checks name (the request that last took each leaked one).",
    },
    "waste": {
        "attach": "Page waste: not provided. It needs each running request's length, which the source does not report.",
        "*": "Page waste: not provided. It needs each running request's length at a step, which this capture does "
        "not record.",
    },
    "latencies": {
        "*": "Latencies: not provided. This capture stores each request when it finishes, without its arrival and "
        "admission times.",
    },
    "in_flight": {
        "*": "Requests in flight: not provided. A request's record is written when it ends, and this source records "
        "no arrival events to show it before (kvscope's engine records them at level full).",
    },
    "tenants": {
        "*": "Sharing between tenants: not provided. {engine}'s requests carry no principal (user or tenant).",
    },
    "regret": {
        "attach": "Age, idle time and 'evicted, then needed again' are not provided: the engine's events record no "
        "prefix match, so kvscope cannot tell when a page was last used or needed again.",
        "*": "Age, idle time and 'evicted, then needed again' are not provided: {engine}'s prefix lookups record "
        "how many blocks hit, not the block each one stopped at.",
    },
    "tiers": {
        "*": "This source provides no host tier ({engine} reports one tier, the device): only the device is followed.",
    },
    "request_stream": {
        "*": "Hit rate vs cache capacity for this engine's traffic: not provided. The curve replays the run's "
        "request stream, and {engine}'s capture holds no prompt tokens (`kvscope plan` takes a request trace "
        "instead).",
    },
    "usage.split": {
        "*": "Free and evictable tokens: not provided. This source does not split its pool (vLLM, for one, counts "
        "cached but unused blocks as free), so only the used tokens are shown.",
    },
    "tree": {
        "*": "The cache tree: not provided. This source records no tree events or snapshots.",
    },
    "evictions": {
        "probe": "Evictions: not recorded. The probe ran at level summary, which leaves {engine}'s tree methods "
        "unpatched (`kvscope instrument --level full` records every eviction).",
        "*": "Evictions: not provided by this source.",
    },
    "gpu": {
        "*": "GPU memory and utilization: not shown. The run was recorded inside {engine}, possibly on another "
        "machine, and this page would show this machine's GPU.",
    },
}


@dataclass(frozen=True)
class Capabilities:
    """What a run's source provides. `kind`: engine / attach / probe; `engine`: kvscope, vllm, sglang ..."""

    kind: str
    engine: str
    version: str | None
    provides: frozenset[str]
    block_size: int | None = None

    def has(self, *names: str) -> bool:
        return all(name in self.provides for name in names)

    def lacks(self, name: str) -> bool:
        return name not in self.provides

    def cannot_show(self, name: str) -> str:
        """The one line this source shows in place of `name`'s section."""
        lines = CANNOT_SHOW.get(name, {})
        line = lines.get(self.kind) or lines.get("*") or f"{CAPABILITIES.get(name, name)}: not provided by this source."
        return line.format(engine=self.engine, unit=self.unit)

    def with_data(self, present: Mapping[str, bool]) -> Capabilities:
        """Add (True) or remove (False) the capabilities the data shows, e.g. {"tree_snapshots": True}."""
        added = {name for name, there in present.items() if there}
        return replace(self, provides=(self.provides | added) - (set(present) - added))

    @property
    def unit(self) -> str:
        """What the source's pool is made of: slots, blocks or pages."""
        return "slots" if self.has("slots") else "blocks" if self.has("blocks") else "pages"

    @property
    def title(self) -> str:
        """e.g. "vllm 0.32.0" ("kvscope" for the own engine)."""
        return self.engine + (f" {self.version}" if self.version else "")


def capabilities(config: Mapping[str, Any]) -> Capabilities:
    """The capabilities of a run from its config (the runs table's JSON, parsed)."""
    source = config.get("source")
    if not isinstance(source, Mapping):
        return _engine(config)
    kind = str(source.get("kind") or "")
    engine = str(source.get("engine") or "unknown engine")
    version = None if source.get("version") in (None, "") else str(source.get("version"))
    named = _names(source.get("provides"))
    block_size = _positive(source.get("block_size"))
    if kind == "attach":
        provided = {"attach_loop", *(cap for name in named for cap in ATTACH_PROVIDES.get(name, ()))}
        return Capabilities("attach", engine, version, frozenset(provided), block_size)
    if kind == "probe":
        extra = {name for name in named if name in PROBE_EXTRA}
        lacking = _names(source.get("lacks"))  # NOTE: what this run's level left out (SGLang at summary: evictions)
        given = (PROBE_PROVIDES | PROBE_ENGINES.get(engine, frozenset()) | extra) - lacking
        return Capabilities("probe", engine, version, frozenset(given), block_size)
    return Capabilities(kind or "unknown", engine, version, frozenset(), block_size)


def capabilities_of_json(text: str | None) -> Capabilities:
    """capabilities() of a config stored as JSON (an unreadable one reads as an own-engine run's)."""
    try:
        config = json.loads(text or "{}")
    except (TypeError, ValueError):
        config = {}
    return capabilities(config if isinstance(config, dict) else {})


def _engine(config: Mapping[str, Any]) -> Capabilities:
    return Capabilities("engine", "kvscope", None, ENGINE_PROVIDES)


def _names(raw: Any) -> set[str]:
    return {str(name) for name in raw} if isinstance(raw, Iterable) and not isinstance(raw, str | bytes) else set()


def _positive(raw: Any) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0 else None
