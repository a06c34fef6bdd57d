"""SGLang's KV-event stream: where the prefix cache's full pages come and go, published on ZMQ.

    pages = CachedPages(engine.memory.cache, page_size)
    publisher = KVEventPublisher(config, zmq_context)
    publisher.publish(pages.diff())        # after each engine step; nothing is sent for no change

NOTE: the wire format is SGLang's (>= 0.5.22, map-encoded events; research note §1):
    PUB frames      topic | seq (8 bytes, big-endian, from 0) | msgpack KVEventBatch
    KVEventBatch    [ts, [event, ...], attn_dp_rank]   (a positional array; the replica's rank, 0 for one)
    event           {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                     "block_size", "lora_id", "medium"}
                    {"type": "BlockRemoved", "block_hashes", "medium"} | {"type": "AllBlocksCleared"}
    replay          a DEALER/REQ sends [b"", start_seq (8 bytes)] to the ROUTER; it answers every
                    kept batch with seq >= start_seq as [b"", topic, seq, payload], then
                    [b"", b"" (no topic, as SGLang 0.5.23 sends it), seq = -1 (signed), b""] to end
Block hashes are SGLang 0.5.23's (HiCache's page hash, `get_hash_str` page by page, and the
event id `hash_str_to_int64` of mem_cache/utils.py; read in the released wheel):
    digest(page)    sha256(digest(parent page), all 32 bytes, absent for a page under the root
                           | the page's token ids as uint32 little-endian)
    block hash      the digest's first 8 bytes as a signed big-endian int64
so a consumer that recomputes SGLang's hashes from token ids (a HiCache storage key is the
digest's hex, a Dynamo-style indexer the block hash) finds kvscope's. One BlockStored covers a
run of new pages that chain one on the next (its token_ids are block_size per hash). The stream
starts with AllBlocksCleared (seq 0).
With `serve --dp-size N`, rank r publishes on the endpoint's tcp:// port + r (and its replay
endpoint's), as SGLang 0.5.23's publisher offsets them (`offset_endpoint_port`); an inproc://
name gets "_dp{r}"; an ipc:// endpoint cannot be shared by several ranks and is refused.
Only the full-attention pages are published: SWA window frees (tombstones) are silent, as in SGLang.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

import msgspec
import numpy as np
import zmq

from kvscope.telemetry.page_hash import block_hash, page_digest

MEDIUM = "GPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
PUBLISHERS = ("null", "zmq")
FORMATS = ("default", "dynamo")


# -- the messages -------------------------------------------------------------------------------


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KVEvent]
    attn_dp_rank: int | None = None


ATTN_DP_RANK = 0  # SGLang's publisher stamps its rank; a server with one rank is rank 0
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


# -- the config (`--kv-events-config`) ------------------------------------------------------------


@dataclass(frozen=True)
class KVEventsConfig:
    """SGLang's `--kv-events-config` keys, and vLLM's `enable_kv_cache_events`: events are
    published when the publisher is "zmq" and enable_kv_cache_events is not false; with no
    publisher given, enable_kv_cache_events true means "zmq" (vLLM's rule), else "null".
    `format` "dynamo" (SGLang's) namespaces block hashes by LoRA adapter and cache salt: kvscope
    serves neither, so its hashes, like SGLang's for requests without them, equal "default"'s."""

    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000  # accepted for compatibility: kvscope publishes inline, with no queue
    topic: str = ""
    bind: bool | None = None  # None: SGLang's rule (bind for *, ::, 0.0.0.0, ipc://, inproc://)
    format: str = "default"
    enable_kv_cache_events: bool | None = None  # vLLM's key

    def __post_init__(self) -> None:
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ValueError(f"kv events publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise ValueError(f"kv events {name} must be a ZMQ address such as tcp://*:5557, got {value!r}")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"kv events {name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv events topic must be a string, got {self.topic!r}")
        for name in ("bind", "enable_kv_cache_events"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"kv events {name} must be true or false, got {value!r}")
        if self.format not in FORMATS:
            raise ValueError(f"kv events format must be one of {', '.join(FORMATS)}, got {self.format!r}")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """The config of a JSON object; ValueError (one line) on bad JSON, unknown keys or values."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"kv events config is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise ValueError("kv events config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown kv events config key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        return cls(**data)

    def for_rank(self, rank: int) -> KVEventsConfig:
        """The config of data-parallel rank `rank`: its endpoints offset as SGLang offsets them."""
        if rank == 0:
            return self
        return replace(
            self,
            endpoint=rank_endpoint(self.endpoint, rank),
            replay_endpoint=None if self.replay_endpoint is None else rank_endpoint(self.replay_endpoint, rank),
        )

    def check_ranks(self, dp_size: int) -> None:
        """ValueError (one line) when the endpoints cannot be offset for dp_size ranks."""
        if dp_size == 1 or not self.enabled:
            return
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "inproc://")):
                raise ValueError(
                    f"kv events {name} {value!r} cannot be shared by --dp-size {dp_size} ranks: "
                    "use a tcp:// endpoint (rank r publishes on its port + r)"
                )
            if value is not None and value.startswith("tcp://"):
                port = value.rpartition(":")[2]
                if not port.isdigit() or int(port) + dp_size - 1 > 65535:
                    raise ValueError(f"kv events {name} {value!r} has no port to offset for {dp_size} ranks")

    @property
    def enabled(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return publisher == "zmq" and self.enable_kv_cache_events is not False

    def binds(self) -> bool:
        """Whether the PUB socket binds its endpoint (else it connects, as SGLang's publisher)."""
        if self.bind is not None:
            return self.bind
        endpoint = self.endpoint
        return any(mark in endpoint for mark in ("*", "::", "0.0.0.0")) or endpoint.startswith(("ipc://", "inproc://"))


def rank_endpoint(endpoint: str, rank: int) -> str:
    """SGLang's per-rank endpoint: a tcp:// port + rank, an inproc:// name + "_dp{rank}"."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


# -- the cache's pages ------------------------------------------------------------------------------


class Page(NamedTuple):
    parent_hash: int | None
    token_bytes: bytes  # the page's token ids, int32 little-endian (= uint32: ids are >= 0)
    digest: bytes  # SGLang's page digest: its hex is the page's HiCache storage key


NodePages = list[tuple[int, Page]]
NodeMemo = dict[tuple[int, int, bytes | None], NodePages]  # (node id, key length, parent digest) -> its pages


def cached_pages(cache: Any, page_size: int, memo: NodeMemo | None = None) -> dict[int, Page]:
    """Every full page of the cache's tree by block hash, parents before children; empty for a
    cache with no tree (chunk, none). `memo`: each node's pages from the last call, updated
    in place (a node's tokens change only when a split cuts its front: its key length changes).

    NOTE: a node's key is its token ids as int32 bytes and starts on a page boundary; a
    trailing partial page (none in a page-aligned tree) is not published, nor its subtree."""
    root = cache.root  # NOTE: BasePrefixCache.root: None for a cache with no tree
    pages: dict[int, Page] = {}
    if root is None:
        return pages
    old_memo, new_memo = memo or {}, {}
    page_bytes = page_size * 4
    stack: list[tuple[Any, bytes | None]] = [(child, None) for child in reversed(child_nodes(root))]
    while stack:
        node, parent_digest = stack.pop()
        key = node.key if isinstance(node.key, bytes) else bytes(node.key)
        memo_key = (node.id, len(key), parent_digest)
        node_pages = new_memo[memo_key] = old_memo.get(memo_key) or node_page_list(key, page_bytes, parent_digest)
        pages.update(node_pages)
        if len(key) % page_bytes or not node_pages:
            continue
        stack += [(child, node_pages[-1][1].digest) for child in reversed(child_nodes(node))]
    if memo is not None:  # NOTE: only the nodes still in the tree stay
        memo.clear()
        memo.update(new_memo)
    return pages


def child_nodes(node: Any) -> list[Any]:
    """A node's children. NOTE: the scoped tree files a list of copies (one per principal set) under
    each first page; copies of one page share its block hash, which stays stored while any copy holds it."""
    out: list[Any] = []
    for child in node.children.values():
        if isinstance(child, list):
            out.extend(child)
        else:
            out.append(child)
    return out


def node_page_list(key: bytes, page_bytes: int, parent_digest: bytes | None) -> NodePages:
    out: NodePages = []
    for start in range(0, len(key) - page_bytes + 1, page_bytes):
        token_bytes = key[start : start + page_bytes]
        digest = page_digest(parent_digest, token_bytes)
        parent_hash = None if parent_digest is None else block_hash(parent_digest)
        out.append((block_hash(digest), Page(parent_hash, token_bytes, digest)))
        parent_digest = digest
    return out


def prompt_page_hashes(input_ids: Sequence[int], page_size: int) -> list[int]:
    """The block hashes of a prompt's full pages, first page first (what a cache holding the
    prompt as a prefix publishes for it)."""
    key = np.asarray(input_ids, dtype=np.int32).tobytes()
    return [page_hash for page_hash, _ in node_page_list(key, page_size * 4, None)]


def page_deltas(events: list[KVEvent]) -> tuple[list[int], list[int]]:
    """(stored, removed) block hashes of a diff's events."""
    stored: list[int] = []
    removed: list[int] = []
    for event in events:
        if isinstance(event, BlockStored):
            stored += event.block_hashes
        elif isinstance(event, BlockRemoved):
            removed += event.block_hashes
    return stored, removed


def token_list(token_bytes: bytes) -> list[int]:
    return list(memoryview(token_bytes).cast("i"))


class CachedPages:
    """The cache's pages as of the last diff; `diff` turns what changed since into events."""

    def __init__(self, cache: Any, page_size: int) -> None:
        self.cache = cache
        self.page_size = page_size
        self.pages: dict[int, Page] = {}
        self.memo: NodeMemo = {}

    def diff(self) -> list[KVEvent]:
        now = cached_pages(self.cache, self.page_size, self.memo)
        removed = [h for h in self.pages if h not in now]
        stored = [(h, page) for h, page in now.items() if h not in self.pages]
        self.pages = now
        events: list[KVEvent] = []
        if removed:
            events.append(BlockRemoved(removed, MEDIUM))
        events += self._stored_events(stored)
        return events

    def _stored_events(self, stored: list[tuple[int, Page]]) -> list[KVEvent]:
        """One BlockStored per run of new pages each chained on the one before."""
        events: list[KVEvent] = []
        for page_hash, page in stored:
            last = events[-1] if events else None
            if isinstance(last, BlockStored) and page.parent_hash == last.block_hashes[-1]:
                last.block_hashes.append(page_hash)
                last.token_ids += token_list(page.token_bytes)
            else:
                events.append(
                    BlockStored(
                        [page_hash], page.parent_hash, token_list(page.token_bytes), self.page_size, None, MEDIUM
                    )
                )
        return events


# -- the publisher -----------------------------------------------------------------------------------


class KVEventPublisher:
    """PUB socket plus an optional replay ROUTER, driven from the scheduler's thread: `publish`
    never blocks (past the high-water mark ZMQ drops, and the subscriber sees a gap in seq);
    `serve_replay` answers the replay requests waiting on the ROUTER."""

    def __init__(self, config: KVEventsConfig, context: zmq.Context[Any], dp_rank: int = ATTN_DP_RANK) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.topic = config.topic.encode()
        self.seq = 0
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.setsockopt(zmq.LINGER, 1000)
        (self.pub.bind if config.binds() else self.pub.connect)(config.endpoint)
        self.replay: zmq.Socket[Any] | None = None
        if config.replay_endpoint is not None:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))  # a whole replay fits
            self.replay.bind(config.replay_endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = encode_batch(KVEventBatch(time.time(), events, self.dp_rank))
        seq = self.seq.to_bytes(8, "big")
        self.pub.send_multipart((self.topic, seq, payload))
        self.kept.append((self.seq, payload))
        self.seq += 1

    def serve_replay(self) -> None:
        """Answer every waiting replay request; a malformed one is answered with the end marker."""
        if self.replay is None:
            return
        while True:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, start = frames[0], frames[-1]
            first = int.from_bytes(start, "big") if len(start) == 8 else self.seq
            for seq, payload in self.kept:
                if seq >= first:
                    self.replay.send_multipart((identity, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))  # NOTE: SGLang's: no topic

    def close(self) -> None:
        self.pub.close()
        if self.replay is not None:
            self.replay.close()
