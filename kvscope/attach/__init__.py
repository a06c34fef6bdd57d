"""`kvscope attach`: watch a real SGLang or vLLM server through its KV-event stream and metrics.

    wire.py     the KV-event wire of every SGLang and vLLM version, decoded into Stored / Removed /
                Cleared records (no engine package needed)
    subscriber.py   the live stream: SUB socket, sequence gaps filled from replay, restarts, late join
    forest.py       the cached-prefix forest per tier at page granularity, rebuilt from the batches
    discover.py     what the server is: SGLang, vLLM or kvscope serve, its version, block size, capacity and
                    KV-event endpoints, and warnings for known-bad stream versions
    scrape.py       its /metrics, normalized into EngineSample (None where the engine does not say)

NOTE: this package runs beside a real engine on a box without torch: it never imports torch,
kvscope.engine, kvscope.cache, kvscope.mem or kvscope.server.
"""

from kvscope.attach.discover import EngineInfo, discover
from kvscope.attach.errors import AttachError
from kvscope.attach.forest import ForestIntegrityError, PageForest
from kvscope.attach.scrape import EngineSample, parse_metrics, scrape
from kvscope.attach.subscriber import EventSubscriber
from kvscope.attach.wire import (
    TIERS,
    Batch,
    Cleared,
    Frame,
    Removed,
    Stored,
    WireError,
    WireEvent,
    block_key,
    decode_batch,
    decode_frames,
    decode_replay,
    tier_of,
)

__all__ = [
    "TIERS",
    "AttachError",
    "Batch",
    "Cleared",
    "EngineInfo",
    "EngineSample",
    "EventSubscriber",
    "ForestIntegrityError",
    "Frame",
    "PageForest",
    "Removed",
    "Stored",
    "WireError",
    "WireEvent",
    "block_key",
    "decode_batch",
    "decode_frames",
    "decode_replay",
    "discover",
    "parse_metrics",
    "scrape",
    "tier_of",
]
