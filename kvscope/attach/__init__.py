"""`kvscope attach`: watch a real SGLang or vLLM server through its KV-event stream and metrics.

    wire.py     the KV-event wire of every SGLang and vLLM version, decoded into Stored / Removed /
                Cleared records (no engine package needed)
    subscriber.py   the live stream: SUB socket, sequence gaps filled from replay, restarts, late join
    forest.py       the cached-prefix forest per tier at page granularity, rebuilt from the batches

NOTE: this package runs beside a real engine on a box without torch: it never imports torch,
kvscope.engine, kvscope.cache, kvscope.mem or kvscope.server.
"""

from kvscope.attach.forest import ForestIntegrityError, PageForest
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
    "Batch",
    "Cleared",
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
    "tier_of",
]
