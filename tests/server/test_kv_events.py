"""SGLang's KV-event stream from the real scheduler process: a subscriber that decodes every
batch rebuilds exactly the cache's pages at each quiet point (evictions included), every page's
parent chain spells a prefix the server really cached, sequence numbers are contiguous, and the
replay socket hands back the batches a late subscriber missed, byte for byte.
`--kv-events-config` takes SGLang's keys and refuses anything else in one line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvscope.engine import Engine, EngineConfig, PoolConfig, Req
from kvscope.server.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    cached_pages,
    decode_batch,
)
from tests.server.test_scheduler_process import MODEL, prompts, serve, short_dir  # noqa: F401 - fixture

PAGE_SIZE = 4
ENGINE = EngineConfig(pool=PoolConfig(kv_size_tokens=192, page_size=PAGE_SIZE, max_running_requests=4,
                                      max_context_len=128), device="cpu", strict=True)
TIMEOUT_S = 30.0
Pages = dict[int, tuple[int | None, list[int]]]


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
            assert empty == b"" and topic == self.topic
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                return out
            out.append((number, payload))
            self.replayed[number] = payload

    def batches(self) -> list[KVEventBatch]:
        every = {**self.replayed, **self.live}
        assert sorted(every) == list(range(len(every))), f"a gap in the sequence numbers: {sorted(every)}"
        return [decode_batch(every[seq]) for seq in sorted(every)]

    def pages(self) -> Pages:
        return rebuild(self.batches())

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
    return {h: (p.parent_hash, np.frombuffer(p.token_bytes, dtype=np.int32).tolist())
            for h, p in cached_pages(engine.memory.cache, PAGE_SIZE).items()}


def prefix_of(pages: Pages, block: int) -> list[int]:
    tokens: list[int] = []
    node: int | None = block
    while node is not None:
        parent, page_tokens = pages[node]
        tokens = page_tokens + tokens
        node = parent
    return tokens


def test_a_subscriber_rebuilds_the_cache_pages_and_replay_fills_what_it_missed(short_dir: Path) -> None:  # noqa: F811
    config = KVEventsConfig(publisher="zmq", endpoint=f"ipc://{short_dir}/kv", replay_endpoint=f"ipc://{short_dir}/rp",
                            topic="kv")
    local = Engine(ENGINE, MODEL)
    requests = [(f"r{i}", p, 8 + i) for i, p in enumerate(prompts(7, 8))]
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
                for block in expected:
                    path = prefix_of(expected, block)
                    assert any(seq[: len(path)] == path for seq in sequences), "a page chain no request spelled"
            last = max(sub.live)
            assert sorted(sub.live) == list(range(min(sub.live), last + 1)), "the live stream skipped a batch"
            late = sub.replay(3)
            assert late == [(seq, sub.live.get(seq, sub.replayed.get(seq))) for seq in range(3, last + 1)]
            assert sub.replay(last + 1) == []
            events = [e for batch in sub.batches() for e in batch.events]
    finally:
        context.destroy(linger=0)
    assert local.stats.evicted_tokens > 0
    assert any(isinstance(e, BlockRemoved) for e in events), "the small pool evicted: pages must leave"


def test_the_config_takes_sglang_keys() -> None:
    text = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                       "buffer_steps": 100, "hwm": 1000, "max_queue_size": 10, "topic": "kv"})
    config = KVEventsConfig.from_json(text)
    assert config.enabled and config.binds() and config.buffer_steps == 100 and config.topic == "kv"
    assert not KVEventsConfig.from_json("{}").enabled
    assert not KVEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:5557").binds()
    assert KVEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:5557", bind=True).binds()
    assert KVEventsConfig(publisher="zmq", endpoint="ipc:///tmp/x").binds()


@pytest.mark.parametrize(("text", "says"), [
    ('{"publisher": "zmq", "endpont": "tcp://*:1"}', "unknown kv events config key(s): endpont"),
    ('{"publisher": "kafka"}', "publisher must be one of null, zmq"),
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ('{"buffer_steps": "10"}', "buffer_steps must be an integer >= 1"),
    ('{"endpoint": "localhost:5557"}', "endpoint must be a ZMQ address"),
    ('{"bind": "yes"}', "bind must be true or false"),
    ('{"format": "dynamo"}', "format 'dynamo' is not supported"),
    ('[1, 2]', "must be a JSON object"),
    ('{"publisher": ', "kv events config is not JSON"),
])
def test_a_bad_config_is_one_line(text: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        KVEventsConfig.from_json(text)
    assert says in str(err.value) and "\n" not in str(err.value)
