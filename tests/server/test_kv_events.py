"""SGLang's KV-event stream from the real scheduler process: a subscriber that decodes every
batch rebuilds exactly the cache's pages at each quiet point (evictions included), every page's
parent chain spells a prefix the server really cached, sequence numbers are contiguous, and the
replay socket hands back the batches a late subscriber missed, byte for byte. Block hashes are
SGLang 0.5.23's, checked against SGLang's own function's output on the same tokens, and every
batch says rank 0. `--kv-events-config` takes SGLang's keys (format "dynamo" included) and vLLM's
enable_kv_cache_events, and refuses anything else in one line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvscope.engine import CacheConfig, Engine, EngineConfig, PoolConfig, Req
from kvscope.server.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    cached_pages,
    decode_batch,
    node_page_list,
)
from kvscope.server.protocol import FlushCacheOut, FlushCacheReq
from tests.server.test_scheduler_process import MODEL, prompts, serve, short_dir  # noqa: F401 - fixture

PAGE_SIZE = 4
ENGINE = EngineConfig(
    pool=PoolConfig(kv_size_tokens=192, page_size=PAGE_SIZE, max_running_requests=4, max_context_len=128),
    device="cpu",
    strict=True,
)
TIMEOUT_S = 30.0
Pages = dict[int, tuple[int | None, list[int]]]

# NOTE: made by SGLang 0.5.23's own get_hash_str (its native page hash) and hash_str_to_int64 on these
# tokens with page_size 4 (tests/server/data/sglang_hash_vectors.py says how). "branch" shares the
# trunk's first 2 pages, then has 2 of its own; "last_digest" is its last page's digest (hex).
TRUNK = [(i * 37 + 11) % 500 + 3 for i in range(40)]
BRANCH = TRUNK[:8] + [(i * 53 + 7) % 500 + 3 for i in range(8)]
SGLANG_VECTORS = {
    "trunk": (
        TRUNK,
        [
            3815746184421846117,
            -5921859961963763885,
            4997794459189861004,
            -5476093876805891296,
            -7569460905722751660,
            4760520530061387283,
            7659227183944990754,
            6897603871589100525,
            -2908309191659037156,
            -928214672411263626,
        ],
        "f31e51ac5f9efd7685fd2a2e1498d22a3d5991456163db828eeb78864eb6bb7d",
    ),
    "branch": (
        BRANCH,
        [3815746184421846117, -5921859961963763885, 1855182388418527155, -5959878918115434848],
        "ad4a41b36563dea09a51cb152f884d7b7e2eda2c9603afa231de1fbd3d1eccf7",
    ),
}


class Subscriber:
    """A SUB socket on the stream and a DEALER on the replay socket; rebuilds the page set."""

    def __init__(self, context: zmq.Context[Any], config: KVEventsConfig) -> None:
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
        self.sub.connect(config.endpoint)
        assert config.replay_endpoint is not None
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(config.replay_endpoint)
        self.topic = config.topic.encode()
        self.live: dict[int, bytes] = {}  # seq -> payload, as the SUB socket got them
        self.replayed: dict[int, bytes] = {}

    def pump(self, timeout_s: float) -> bool:
        if not self.sub.poll(int(timeout_s * 1000)):
            return False
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        self.live[int.from_bytes(seq, "big")] = payload
        return True

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            assert self.dealer.poll(int(TIMEOUT_S * 1000)), "the replay socket did not answer"
            empty, topic, seq, payload = self.dealer.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:  # NOTE: SGLang 0.5.23's end marker: no topic, no payload
                assert (empty, topic, payload) == (b"", b"", b"")
                return out
            assert empty == b"" and topic == self.topic
            out.append((number, payload))
            self.replayed[number] = payload

    def batches(self) -> list[KVEventBatch]:
        every = {**self.replayed, **self.live}
        assert sorted(every) == list(range(len(every))), f"a gap in the sequence numbers: {sorted(every)}"
        return [decode_batch(every[seq]) for seq in sorted(every)]

    def pages(self) -> Pages:
        return rebuild(self.batches())

    def wait_until_held(self, hashes: list[int]) -> bool:
        """Whether every page of `hashes` is in the rebuilt set within the timeout."""
        deadline = time.monotonic() + TIMEOUT_S
        while not set(hashes) <= set(self.pages()) and time.monotonic() < deadline:
            self.pump(0.2)
        return set(hashes) <= set(self.pages())

    def wait_for(self, expected: Pages) -> Pages:
        deadline = time.monotonic() + TIMEOUT_S
        while (pages := self.pages()) != expected and time.monotonic() < deadline:
            self.pump(0.2)
        return pages


def rebuild(batches: list[KVEventBatch]) -> Pages:
    pages: Pages = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                pages.clear()
            elif isinstance(event, BlockStored):
                size = event.block_size
                assert len(event.token_ids) == size * len(event.block_hashes)
                for i, block in enumerate(event.block_hashes):
                    parent = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
                    assert parent is None or parent in pages, "a page stored before its parent"
                    pages[block] = (parent, event.token_ids[i * size : (i + 1) * size])
            else:
                for block in event.block_hashes:
                    assert block in pages, "a page removed that was never stored"
                    del pages[block]
    return pages


def expected_pages(engine: Engine) -> Pages:
    return {
        h: (p.parent_hash, np.frombuffer(p.token_bytes, dtype=np.int32).tolist())
        for h, p in cached_pages(engine.memory.cache, PAGE_SIZE).items()
    }


def prefix_of(pages: Pages, block: int) -> list[int]:
    tokens: list[int] = []
    node: int | None = block
    while node is not None:
        parent, page_tokens = pages[node]
        tokens = page_tokens + tokens
        node = parent
    return tokens


def token_bytes(tokens: list[int]) -> bytes:
    return np.array(tokens, dtype=np.int32).tobytes()


@pytest.mark.parametrize("name", sorted(SGLANG_VECTORS))
def test_block_hashes_are_sglangs_on_the_same_tokens(name: str) -> None:
    tokens, hashes, last_digest = SGLANG_VECTORS[name]
    whole = node_page_list(token_bytes(tokens), PAGE_SIZE * 4, None)
    assert [h for h, _ in whole] == hashes
    assert whole[-1][1].digest.hex() == last_digest
    assert [page.parent_hash for _, page in whole] == [None, *hashes[:-1]]
    # as a tree holds it: a node of 2 pages under the root, its child chaining on its last page's digest
    first = node_page_list(token_bytes(tokens[:8]), PAGE_SIZE * 4, None)
    rest = node_page_list(token_bytes(tokens[8:]), PAGE_SIZE * 4, first[-1][1].digest)
    assert first + rest == whole


def test_the_scoped_trees_copies_are_published_by_their_shared_hashes() -> None:
    """The scoped tree files a list of copies under a first page (one per principal set); walking it
    as one child per page crashed the scheduler of `serve --cache scoped-radix --kv-events-config`."""
    config = EngineConfig(
        pool=ENGINE.pool, cache=CacheConfig(kind="scoped-radix", promote_k=None), device="cpu", strict=True
    )
    engine = Engine(config, MODEL)
    prompt = np.array(SGLANG_VECTORS["trunk"][0], dtype=np.int32)
    engine.run([Req("alice", prompt, 2, user="alice"), Req("bob", prompt, 2, user="bob")])
    copies = [child for child in engine.memory.cache.root.children.values() if isinstance(child, list)]
    assert copies and max(len(c) for c in copies) == 2, "each user holds a private copy of the prompt"
    pages = expected_pages(engine)
    hashes = SGLANG_VECTORS["trunk"][1]
    assert set(hashes) <= set(pages) and [pages[h][0] for h in hashes] == [None, *hashes[:-1]]


def test_a_subscriber_rebuilds_the_cache_pages_and_replay_fills_what_it_missed(short_dir: Path) -> None:  # noqa: F811
    config = KVEventsConfig(
        publisher="zmq", endpoint=f"ipc://{short_dir}/kv", replay_endpoint=f"ipc://{short_dir}/rp", topic="kv"
    )
    local = Engine(ENGINE, MODEL)
    trunk = np.array(SGLANG_VECTORS["trunk"][0], dtype=np.int32)  # first, so its pages are there to see
    requests = [("trunk", trunk, 2), *[(f"r{i}", p, 8 + i) for i, p in enumerate(prompts(7, 8))]]
    sequences: list[list[int]] = []
    context: zmq.Context[Any] = zmq.Context()
    try:
        with serve(short_dir, kv_events=config, engine=ENGINE) as front:
            front.wait_ready()
            sub = Subscriber(context, config)
            missed = sub.replay(0)  # what was published before this subscriber joined
            assert [seq for seq, _ in missed] == [0] and decode_batch(missed[0][1]).events == [AllBlocksCleared()]
            for rid, prompt, max_new in requests:
                front.generate(rid, prompt, max_new)
                front.wait_ended([rid])
                req = Req(rid, prompt, max_new)
                local.run([req])
                assert front.tokens[rid] == req.output_ids
                sequences.append([*prompt.tolist(), *req.output_ids])
                expected = expected_pages(local)
                assert sub.wait_for(expected) == expected, f"after {rid}"
                if rid == "trunk":  # the stream's ids are SGLang's for the same tokens
                    hashes = SGLANG_VECTORS["trunk"][1]
                    assert [expected[h] for h in hashes] == [
                        (parent, TRUNK[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
                        for i, parent in enumerate([None, *hashes[:-1]])
                    ]
                for block in expected:
                    path = prefix_of(expected, block)
                    assert any(seq[: len(path)] == path for seq in sequences), "a page chain no request spelled"
            last = max(sub.live)
            assert sorted(sub.live) == list(range(min(sub.live), last + 1)), "the live stream skipped a batch"
            late = sub.replay(3)
            assert late == [(seq, sub.live.get(seq, sub.replayed.get(seq))) for seq in range(3, last + 1)]
            assert sub.replay(last + 1) == []
            batches = sub.batches()
            events = [e for batch in batches for e in batch.events]
    finally:
        context.destroy(linger=0)
    assert {batch.attn_dp_rank for batch in batches} == {0}  # one rank: rank 0, as SGLang stamps it
    assert local.stats.evicted_tokens > 0
    assert any(isinstance(e, BlockRemoved) for e in events), "the small pool evicted: pages must leave"


def test_a_flush_publishes_all_blocks_cleared_and_the_pages_come_back_after(short_dir: Path) -> None:  # noqa: F811
    config = KVEventsConfig(
        publisher="zmq", endpoint=f"ipc://{short_dir}/kv", replay_endpoint=f"ipc://{short_dir}/rp", topic="kv"
    )
    trunk = np.array(SGLANG_VECTORS["trunk"][0], dtype=np.int32)
    context: zmq.Context[Any] = zmq.Context()
    try:
        with serve(short_dir, kv_events=config, engine=ENGINE) as front:
            front.wait_ready()
            sub = Subscriber(context, config)
            sub.replay(0)
            front.generate("trunk", trunk, 2)
            front.wait_ended(["trunk"])
            assert sub.wait_until_held(SGLANG_VECTORS["trunk"][1])
            front.send(FlushCacheReq("f1"))
            deadline = time.monotonic() + TIMEOUT_S
            while not front.flushes and time.monotonic() < deadline:
                front.receive()
            assert front.flushes == [FlushCacheOut("f1", True)]
            assert sub.wait_for({}) == {}
            cleared = [decode_batch(payload).events for payload in sub.live.values()]
            assert [AllBlocksCleared()] in cleared  # SGLang's reset event, not one BlockRemoved per page
            front.generate("again", trunk, 2)
            front.wait_ended(["again"])
            assert sub.wait_until_held(SGLANG_VECTORS["trunk"][1])
    finally:
        context.destroy(linger=0)


def test_the_config_takes_sglang_keys() -> None:
    text = json.dumps(
        {
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "buffer_steps": 100,
            "hwm": 1000,
            "max_queue_size": 10,
            "topic": "kv",
        }
    )
    config = KVEventsConfig.from_json(text)
    assert config.enabled and config.binds() and config.buffer_steps == 100 and config.topic == "kv"
    assert not KVEventsConfig.from_json("{}").enabled
    assert not KVEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:5557").binds()
    assert KVEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:5557", bind=True).binds()
    assert KVEventsConfig(publisher="zmq", endpoint="ipc:///tmp/x").binds()
    assert KVEventsConfig.from_json('{"publisher": "zmq", "format": "dynamo"}').enabled


@pytest.mark.parametrize(
    ("text", "enabled"),
    [
        ('{"enable_kv_cache_events": true}', True),  # vLLM: no publisher given means zmq
        ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}', True),
        ('{"enable_kv_cache_events": false, "publisher": "zmq"}', False),  # vLLM publishes nothing then
        ('{"enable_kv_cache_events": true, "publisher": "null"}', False),
        ('{"enable_kv_cache_events": false}', False),
    ],
)
def test_the_config_takes_vllms_switch(text: str, enabled: bool) -> None:
    assert KVEventsConfig.from_json(text).enabled is enabled


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"publisher": "zmq", "endpont": "tcp://*:1"}', "unknown kv events config key(s): endpont"),
        ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
        ('{"buffer_steps": "10"}', "buffer_steps must be an integer >= 1"),
        ('{"endpoint": "localhost:5557"}', "endpoint must be a ZMQ address"),
        ('{"bind": "yes"}', "bind must be true or false"),
        ('{"format": "vllm"}', "format must be one of default, dynamo, got 'vllm'"),
        ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events must be true or false"),
        ("[1, 2]", "must be a JSON object"),
        ('{"publisher": ', "kv events config is not JSON"),
    ],
)
def test_a_bad_config_is_one_line(text: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        KVEventsConfig.from_json(text)
    assert says in str(err.value) and "\n" not in str(err.value)
