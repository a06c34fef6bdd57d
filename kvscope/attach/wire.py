"""The KV-event wire of real SGLang and vLLM servers, decoded into one set of plain records.

    frame = decode_frames(sub.recv_multipart())     # a PUB message: topic | seq | payload
    for event in frame.batch.events:                # Stored | Removed | Cleared
        ...

The payload is decoded with msgspec into plain Python values (no engine class is needed) and
then normalized; anything that is not a batch raises WireError with a one-line reason.

NOTE: what each engine version sends (research note attach-real-engines.md §1.1, §1.2, §2):
    batch           [ts, [event, ...], dp_rank]; dp_rank may be absent (vLLM omits a None)
    array events    [tag, field, field, ...] by position: SGLang <= 0.5.19, vLLM <= 0.23
    map events      {"type": tag, field name: value, ...}: SGLang >= 0.5.20, vLLM >= 0.24
    trailing fields with their default value may be left out (omit_defaults); unknown ones are ignored
    BlockStored     block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, then
                    SGLang 0.5.18: metadata (salted requests only) | vLLM: lora_name, extra_keys,
                    group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, ...
    BlockRemoved    block_hashes, medium, then vLLM: group_idx, ...
    block hashes    SGLang: signed int64; vLLM: unsigned 64-bit, or bytes; all become unsigned keys
    token_ids       block_size tokens per hash, in order; the last block may be shorter (SGLang's
                    per-node and per-page events set block_size per event)
    medium          None / GPU -> device; CPU_PINNED (SGLang) / CPU (vLLM) -> host;
                    DISK (SGLang) / STORAGE (vLLM) -> disk; EXTERNAL -> external
    PUB message     topic | seq (8 bytes, big-endian) | payload
    replay answer   [seq, payload] (SGLang <= 0.5.21, vLLM <= 0.23) or [topic, seq, payload]
                    (SGLang >= 0.5.22, vLLM >= 0.24), after the empty envelope frame; the end
                    marker has seq -1 (signed) and an empty payload
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

TIERS = ("device", "host", "disk", "external")
MEDIUM_TIERS: dict[str | None, str] = {
    None: "device",
    "GPU": "device",
    "CPU_PINNED": "host",
    "CPU": "host",
    "DISK": "disk",
    "STORAGE": "disk",
    "EXTERNAL": "external",
}
HASH_MASK = 2**64 - 1
END_OF_REPLAY = -1

# NOTE: array-era field names by position after the tag. Position 6 is SGLang 0.5.18's `metadata`
# map or vLLM's `lora_name`; kvscope reads neither, so one table serves both engines.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
EVENT_FIELDS = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS, "AllBlocksCleared": ()}
REQUIRED_FIELDS = {
    "BlockStored": ("block_hashes", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


class WireError(ValueError):
    """A payload or frame that is not a KV-event batch; the message is one line naming what is wrong."""


def tier_of(medium: str | None) -> str:
    """kvscope's tier name (one of TIERS) for an engine's medium string."""
    try:
        return MEDIUM_TIERS[medium]
    except (KeyError, TypeError):
        raise WireError(f"unknown medium {_show(medium)} (known: {', '.join(m for m in MEDIUM_TIERS if m)})") from None


def block_key(value: int | bytes) -> int:
    """One unsigned key per block hash: a signed int64 is read as its unsigned 64 bits, bytes big-endian."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    return value & HASH_MASK if value < 0 else value


@dataclass(frozen=True, slots=True)
class Stored:
    """Blocks cached in `tier`: block_hashes[i] holds token_ids[i*block_size : (i+1)*block_size] and
    chains on block_hashes[i-1] (the first on `parent`, None at the root); the last may be short."""

    block_hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: str
    group: int = 0  # vLLM's group_idx (KV-cache group of a hybrid model); SGLang: 0
    spec_kind: str | None = None  # vLLM's kv_cache_spec_kind: full_attention, sliding_window, ...
    session_id: str | None = None  # attribution only (SGLang >= 0.5.20, vLLM)

    def pages(self) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """(block hash, its parent's hash, its tokens) per block, in chain order."""
        out: list[tuple[int, int | None, tuple[int, ...]]] = []
        parent = self.parent
        for index, block_hash in enumerate(self.block_hashes):
            start = index * self.block_size
            out.append((block_hash, parent, self.token_ids[start : start + self.block_size]))
            parent = block_hash
        return out


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[int, ...]
    tier: str
    group: int = 0


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


WireEvent = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float  # the publisher's time.time() when it took the events
    events: tuple[WireEvent, ...]
    dp_rank: int | None  # SGLang's attn_dp_rank, vLLM's data_parallel_rank


@dataclass(frozen=True, slots=True)
class Frame:
    topic: bytes
    seq: int
    batch: Batch


# -- frames -----------------------------------------------------------------------------------------


def decode_frames(frames: list[bytes]) -> Frame:
    """A PUB message: [topic, seq (8 bytes, big-endian), payload]."""
    if len(frames) != 3:
        raise WireError(f"a KV-event message has 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    return Frame(bytes(topic), _seq(seq, signed=False), decode_batch(payload))


def decode_replay(frames: list[bytes]) -> Frame | None:
    """A replay answer without its envelope: [seq, payload] or [topic, seq, payload]; None at the end marker."""
    if len(frames) == 2:
        topic, (seq_frame, payload) = b"", frames
    elif len(frames) == 3:
        topic, seq_frame, payload = frames
    else:
        raise WireError(f"a replay answer has 2 frames (seq, payload) or 3 (topic, seq, payload), got {len(frames)}")
    seq = _seq(seq_frame, signed=True)
    if seq == END_OF_REPLAY:
        return None
    if seq < 0:
        raise WireError(f"replay seq must be >= 0 or the end marker -1, got {seq}")
    return Frame(bytes(topic), seq, decode_batch(payload))


def _seq(frame: bytes, signed: bool) -> int:
    if len(frame) != 8:
        raise WireError(f"the seq frame must be 8 bytes (big-endian), got {len(frame)}")
    return int.from_bytes(frame, "big", signed=signed)


# -- the batch --------------------------------------------------------------------------------------


def decode_batch(payload: bytes) -> Batch:
    """A msgpack KV-event batch of any SGLang or vLLM version (see the NOTE at the top)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, TypeError) as err:
        raise WireError(f"payload is not msgpack: {err}") from None
    except RecursionError:
        raise WireError("payload nests too deeply to be a KV-event batch") from None
    try:
        return _batch(raw)
    except RecursionError:  # NOTE: a nesting msgspec could decode but showing it could not
        raise WireError("payload nests too deeply to be a KV-event batch") from None


def _batch(raw: Any) -> Batch:
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        shape = f"an array of {len(raw)}" if isinstance(raw, list) else f"a {_kind(raw)}"
        raise WireError(f"a batch is an array [ts, events, dp_rank?] of 2-3 elements, got {shape}")
    ts, events = raw[0], raw[1]
    dp_rank = raw[2] if len(raw) == 3 else None
    if not _is_number(ts):
        raise WireError(f"batch ts must be a number, got {_show(ts)}")
    if not isinstance(events, list):
        raise WireError(f"batch events must be an array, got {_show(events)}")
    if dp_rank is not None and not _is_int(dp_rank):
        raise WireError(f"batch dp_rank must be an int or nil, got {_show(dp_rank)}")
    return Batch(float(ts), tuple(_event(event, index) for index, event in enumerate(events)), dp_rank)


def _event(raw: Any, index: int) -> WireEvent:
    tag, fields = _tagged_fields(raw, index)
    name = f"event {index} ({tag})"
    for field in REQUIRED_FIELDS[tag]:
        if field not in fields:
            raise WireError(f"{name} has no {field}")
    if tag == "AllBlocksCleared":
        return Cleared()
    block_hashes = _hashes(fields["block_hashes"], f"{name} block_hashes")
    tier = tier_of(_optional(fields, "medium", str, name))
    group = _optional(fields, "group_idx", int, name) or 0
    if tag == "BlockRemoved":
        return Removed(block_hashes, tier, group)
    return _stored(fields, name, block_hashes, tier, group)


def _tagged_fields(raw: Any, index: int) -> tuple[str, dict[str, Any]]:
    """(tag, fields by name) of an array-era [tag, ...] or map-era {"type": tag, ...} event."""
    if isinstance(raw, list) and raw:
        tag, values = raw[0], raw[1:]
    elif isinstance(raw, dict):
        tag, values = raw.get("type"), None
    else:
        raise WireError(f"event {index} must be a tagged array or a map with a type, got {_show(raw)}")
    if not isinstance(tag, str) or tag not in EVENT_FIELDS:
        raise WireError(f"event {index} has an unknown event type {_show(tag)} (known: {', '.join(EVENT_FIELDS)})")
    if values is None:
        return tag, raw
    return tag, dict(zip(EVENT_FIELDS[tag], values, strict=False))


def _stored(fields: dict[str, Any], name: str, block_hashes: tuple[int, ...], tier: str, group: int) -> Stored:
    parent = fields.get("parent_block_hash")
    if parent is not None:
        parent = _hash(parent, f"{name} parent_block_hash")
    token_ids, block_size = fields["token_ids"], fields["block_size"]
    if not isinstance(token_ids, list) or not all(_is_int(token) for token in token_ids):
        raise WireError(f"{name} token_ids must be an array of ints, got {_show(token_ids)}")
    if not _is_int(block_size) or block_size <= 0:
        raise WireError(f"{name} block_size must be a positive int, got {_show(block_size)}")
    num_blocks = -(-len(token_ids) // block_size)  # NOTE: every block full but the last, which holds >= 1
    if num_blocks != len(block_hashes):
        raise WireError(
            f"{name} has {len(token_ids)} token_ids, which do not fill {len(block_hashes)} "
            f"block(s) of block_size {block_size}"
        )
    return Stored(
        block_hashes,
        parent,
        tuple(token_ids),
        block_size,
        tier,
        group,
        _optional(fields, "kv_cache_spec_kind", str, name),
        _optional(fields, "session_id", str, name),
    )


def _hashes(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise WireError(f"{what} must be an array, got {_show(value)}")
    return tuple(_hash(item, what) for item in value)


def _hash(value: Any, what: str) -> int:
    if isinstance(value, bytes) or _is_int(value):
        return block_key(value)
    raise WireError(f"{what} must hold ints or bytes, got {_show(value)}")


def _optional(fields: dict[str, Any], field: str, kind: type, name: str) -> Any:
    value = fields.get(field)
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise WireError(f"{name} {field} must be {kind.__name__} or nil, got {_show(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, float) or _is_int(value)


def _kind(value: Any) -> str:
    names: dict[type, str] = {dict: "map", str: "string", bytes: "binary"}
    return names.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
