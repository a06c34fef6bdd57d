"""`kvscope attach`: watch a real SGLang or vLLM server through its KV-event stream and metrics.

    wire.py     the KV-event wire of every SGLang and vLLM version, decoded into Stored / Removed /
                Cleared records (no engine package needed)

NOTE: this package runs beside a real engine on a box without torch: it never imports torch,
kvscope.engine, kvscope.cache, kvscope.mem or kvscope.server.
"""

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
    "Frame",
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
