"""EventSubscriber on real ZMQ sockets over ipc:// and loopback: frames come out in seq order,
a gap is filled from the replay socket (both replay layouts) or counted lost, duplicates are
dropped, a publisher that restarts on the same endpoint is picked up and followed from its seq 0,
bind mode takes a publisher that connects, a late joiner catches up from the replay buffer, and a
malformed message is counted and skipped. The publishers are kvscope's own SGLang-format
KVEventPublisher and hand-made XPUB/ROUTER sockets (gaps, old layouts, garbage)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvscope.attach.subscriber import EventSubscriber
from kvscope.attach.wire import Frame, Stored, block_key
from kvscope.server.kv_events import (
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventPublisher,
    KVEventsConfig,
    encode_batch,
)

TOPIC = "kv"
TIMEOUT_S = 10.0


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """ipc:// paths must stay short (about 100 bytes): a directory straight under /tmp."""
    path = Path(tempfile.mkdtemp(prefix="kva-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def page_event(seq: int, salt: int = 0) -> BlockStored:
    """One page whose hash names the batch that carried it (signed, as SGLang's hashes are)."""
    return BlockStored([-(seq + 1) - 1000 * salt], None, [seq, seq, seq, seq], 4, None, "GPU")


def payload(seq: int, salt: int = 0) -> bytes:
    return encode_batch(KVEventBatch(time.time(), [page_event(seq, salt)], 0))


def carried(frame: Frame, salt: int = 0) -> bool:
    """The frame's batch is the one page_event(frame.seq, salt) made."""
    (event,) = frame.batch.events
    return isinstance(event, Stored) and event.block_hashes == (block_key(-(frame.seq + 1) - 1000 * salt),)


class RawStream:
    """A hand-driven stream: an XPUB socket (it hears the subscription, so nothing is sent before
    the subscriber listens) and a replay ROUTER answered from a thread out of `kept`."""

    def __init__(self, context: zmq.Context[Any], directory: Path, layout: str = "new", replay: bool = True) -> None:
        self.xpub = context.socket(zmq.XPUB)
        self.xpub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"ipc://{directory}/pub"
        self.xpub.bind(self.endpoint)
        self.layout = layout
        self.kept: dict[int, bytes] = {}
        self.release: threading.Event | None = None  # set: the next replay request waits for it
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.replay_endpoint: str | None = None
        self.thread: threading.Thread | None = None
        if replay:
            self.replay_endpoint = f"ipc://{directory}/replay"
            router = context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
            self.thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self.thread.start()

    def wait_subscribed(self) -> None:
        assert self.xpub.poll(int(TIMEOUT_S * 1000)), "the subscriber never subscribed"
        assert self.xpub.recv() == b"\x01" + TOPIC.encode()

    def send(self, seq: int, live: bool = True, body: bytes | None = None) -> None:
        data = payload(seq) if body is None else body
        with self.lock:
            self.kept[seq] = data
        if live:
            self.xpub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), data])

    def keep(self, *seqs: int) -> None:
        for seq in seqs:
            self.send(seq, live=False)

    def _serve(self, router: zmq.Socket[Any]) -> None:
        while not self.stop.is_set():
            if not router.poll(20):
                continue
            identity, *_, start = router.recv_multipart()
            if self.release is not None:
                assert self.release.wait(TIMEOUT_S)
                self.release = None
            with self.lock:
                kept = sorted(self.kept.items())
            for seq, data in kept:
                if seq >= int.from_bytes(start, "big"):
                    router.send_multipart([identity, b"", *self._head(), seq.to_bytes(8, "big"), data])
            router.send_multipart([identity, b"", *self._head(), (-1).to_bytes(8, "big", signed=True), b""])
        router.close()

    def _head(self) -> list[bytes]:
        return [TOPIC.encode()] if self.layout == "new" else []  # SGLang <= 0.5.21 sends no topic

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        self.xpub.close()


class Served:
    """kvscope's KVEventPublisher in its own context (as in its own process), its replay socket
    answered from a thread, as the scheduler loop of `kvscope serve` does."""

    def __init__(self, config: KVEventsConfig, salt: int = 0) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.publisher = KVEventPublisher(config, self.context)
        self.salt = salt
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        with self.lock:
            self.publisher.publish(events)

    def publish_page(self) -> int:
        """Publish the next batch (one page named after its seq); its seq."""
        seq = self.publisher.seq
        self.publish([page_event(seq, self.salt)])
        return seq

    def _serve(self) -> None:
        while not self.stop.wait(0.005):
            with self.lock:
                self.publisher.serve_replay()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.publisher.close()
        self.context.destroy(linger=0)


def drain(subscriber: EventSubscriber, done: Callable[[list[Frame]], bool]) -> list[Frame]:
    frames: list[Frame] = []
    deadline = time.monotonic() + TIMEOUT_S
    while not done(frames) and time.monotonic() < deadline:
        frames += subscriber.poll(50)
    assert done(frames), f"timed out with seqs {[f.seq for f in frames]}"
    return frames


def publish_until_heard(served: Served, subscriber: EventSubscriber) -> list[Frame]:
    """Publish a batch every 50 ms until the subscriber gets one (the SUB socket connects late)."""
    frames: list[Frame] = []
    deadline = time.monotonic() + TIMEOUT_S
    while not frames and time.monotonic() < deadline:
        served.publish_page()
        frames = subscriber.poll(50)
    assert frames, "the subscriber never heard the publisher"
    return frames


def seqs(frames: list[Frame]) -> list[int]:
    return [frame.seq for frame in frames]


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def raw(context: zmq.Context[Any], short_dir: Path) -> Iterator[RawStream]:
    stream = RawStream(context, short_dir)
    yield stream
    stream.close()


def subscribe(stream: RawStream, replay: bool = True, **kwargs: Any) -> EventSubscriber:
    subscriber = EventSubscriber(
        stream.endpoint, replay_endpoint=stream.replay_endpoint if replay else None, topic=TOPIC, **kwargs
    )
    stream.wait_subscribed()
    return subscriber


# -- tests --------------------------------------------------------------------------------------------


def test_frames_from_kvscopes_publisher_arrive_in_seq_order(short_dir: Path) -> None:
    served = Served(KVEventsConfig(publisher="zmq", endpoint=f"ipc://{short_dir}/kv", topic=TOPIC))
    subscriber = EventSubscriber(f"ipc://{short_dir}/kv", topic=TOPIC)
    try:
        frames = publish_until_heard(served, subscriber)
        last = max(served.publish_page() for _ in range(20))
        frames += drain(subscriber, lambda got: bool(got) and got[-1].seq == last)
    finally:
        subscriber.close()
        served.close()
    assert seqs(frames) == list(range(frames[0].seq, last + 1))
    assert all(carried(frame) and frame.topic == TOPIC.encode() for frame in frames)
    assert (subscriber.lost_batches, subscriber.replayed, subscriber.duplicates) == (0, 0, 0)
    assert subscriber.first_seq == frames[0].seq and subscriber.delivered == len(frames)


@pytest.mark.parametrize("layout", ["new", "old"])
def test_a_gap_is_filled_from_the_replay_in_either_layout(
    context: zmq.Context[Any], short_dir: Path, layout: str
) -> None:
    stream = RawStream(context, short_dir, layout=layout)
    subscriber = subscribe(stream)
    try:
        stream.send(0)
        stream.send(1)
        stream.keep(2, 3)  # the live stream drops them (as past the high-water mark)
        stream.send(4)
        frames = drain(subscriber, lambda got: len(got) >= 5)
    finally:
        subscriber.close()
        stream.close()
    assert seqs(frames) == [0, 1, 2, 3, 4] and all(carried(frame) for frame in frames)
    assert (subscriber.replayed, subscriber.lost_batches, subscriber.gaps) == (3, 0, [])  # 2, 3 and 4 itself


def test_batches_the_replay_delivered_are_not_delivered_again(raw: RawStream) -> None:
    subscriber = subscribe(raw)
    try:
        raw.send(0)
        raw.keep(1, 2, 3, 4, 5)  # the replay already holds 4 and 5 when it answers the gap before 3
        raw.send(3)
        first = drain(subscriber, lambda got: len(got) >= 6)
        raw.send(4)
        raw.send(5)
        raw.send(5)  # a plain duplicate on the live stream
        raw.send(6)
        later = drain(subscriber, lambda got: len(got) >= 1)
    finally:
        subscriber.close()
    assert seqs(first) == [0, 1, 2, 3, 4, 5] and seqs(later) == [6]
    assert subscriber.duplicates == 3 and subscriber.restarts == 0 and subscriber.lost_batches == 0


def test_a_seq_back_to_0_is_a_restart_even_after_a_single_batch(raw: RawStream) -> None:
    subscriber = subscribe(raw)
    try:
        raw.send(0)
        first = drain(subscriber, lambda got: len(got) >= 1)
        raw.send(0, body=payload(0, salt=1))  # a new publisher process: its first batch
        raw.send(1, body=payload(1, salt=1))
        later = drain(subscriber, lambda got: len(got) >= 2)
    finally:
        subscriber.close()
    assert seqs(first) == [0] and seqs(later) == [0, 1] and all(carried(frame, salt=1) for frame in later)
    assert (subscriber.restarts, subscriber.duplicates, subscriber.lost_batches) == (1, 0, 0)


def test_a_gap_the_replay_no_longer_holds_is_counted_lost(raw: RawStream) -> None:
    subscriber = subscribe(raw)
    try:
        raw.send(0)
        raw.keep(3, 4)  # 1 and 2 fell out of the replay buffer
        raw.send(5)
        frames = drain(subscriber, lambda got: len(got) >= 4)
    finally:
        subscriber.close()
    assert seqs(frames) == [0, 3, 4, 5]
    assert (subscriber.lost_batches, subscriber.gaps, subscriber.replayed) == (2, [(1, 2)], 3)


def test_without_a_replay_endpoint_every_gap_is_lost(raw: RawStream) -> None:
    subscriber = subscribe(raw, replay=False)
    try:
        for seq in (0, 3, 4, 9):
            raw.send(seq)
        frames = drain(subscriber, lambda got: len(got) >= 4)
    finally:
        subscriber.close()
    assert seqs(frames) == [0, 3, 4, 9]
    assert (subscriber.lost_batches, subscriber.gaps) == (6, [(1, 2), (5, 8)])


def test_a_replay_that_answers_late_loses_its_gap_and_not_the_next(raw: RawStream) -> None:
    subscriber = subscribe(raw, replay_timeout_ms=1000)
    release = raw.release = threading.Event()  # the first request is answered after the subscriber gave up
    try:
        raw.send(0)
        raw.keep(1)
        raw.send(2)
        first = drain(subscriber, lambda got: len(got) >= 2)
        release.set()  # the late answer (1, then an end marker) goes out before the next request's
        raw.keep(3)
        raw.send(4)
        later = drain(subscriber, lambda got: len(got) >= 2)
    finally:
        subscriber.close()
    assert seqs(first) == [0, 2] and seqs(later) == [3, 4]
    assert (subscriber.replay_timeouts, subscriber.gaps) == (1, [(1, 1)])


def test_a_publisher_that_restarts_on_the_same_endpoint_is_followed_from_its_seq_0(short_dir: Path) -> None:
    config = KVEventsConfig(
        publisher="zmq", endpoint=f"ipc://{short_dir}/kv", replay_endpoint=f"ipc://{short_dir}/rp", topic=TOPIC
    )
    subscriber = EventSubscriber(config.endpoint, replay_endpoint=config.replay_endpoint, topic=TOPIC)
    old = Served(config)
    try:
        old.publish_page()
        assert subscriber.catch_up() == 1  # seq 0, so the stream is followed from its start
        before = subscriber.poll(0) + publish_until_heard(old, subscriber)
        last = max(old.publish_page() for _ in range(40 - old.publisher.seq))
        before += drain(subscriber, lambda got: bool(got) and got[-1].seq == last)
        old.close()
        new = Served(config, salt=1)  # NOTE: a new process: its seq starts at 0 again
        try:
            after = publish_until_heard(new, subscriber)
            last = max(new.publish_page() for _ in range(3))
            after += drain(subscriber, lambda got: bool(got) and got[-1].seq == last)
        finally:
            new.close()
    finally:
        subscriber.close()
    assert seqs(before) == list(range(40)) and all(carried(frame) for frame in before)
    assert seqs(after) == list(range(last + 1)) and all(carried(frame, salt=1) for frame in after)
    assert (subscriber.restarts, subscriber.lost_batches) == (1, 0)


def test_bind_mode_takes_a_publisher_that_connects() -> None:
    subscriber = EventSubscriber("tcp://127.0.0.1:*", topic=TOPIC, bind=True)
    assert subscriber.endpoint.startswith("tcp://127.0.0.1:") and not subscriber.endpoint.endswith("*")
    config = KVEventsConfig(publisher="zmq", endpoint=subscriber.endpoint, topic=TOPIC)
    assert not config.binds()  # SGLang's rule: a concrete tcp host connects
    served = Served(config)
    try:
        frames = publish_until_heard(served, subscriber)
        last = max(served.publish_page() for _ in range(10))
        frames += drain(subscriber, lambda got: bool(got) and got[-1].seq == last)
    finally:
        served.close()
        subscriber.close()
    assert seqs(frames) == list(range(frames[0].seq, last + 1)) and subscriber.lost_batches == 0


def test_a_late_joiner_catches_up_from_what_the_replay_still_buffers(short_dir: Path) -> None:
    config = KVEventsConfig(
        publisher="zmq",
        endpoint=f"ipc://{short_dir}/kv",
        replay_endpoint=f"ipc://{short_dir}/rp",
        topic=TOPIC,
        buffer_steps=5,
    )
    served = Served(config)
    for _ in range(8):
        served.publish_page()
    subscriber = EventSubscriber(config.endpoint, replay_endpoint=config.replay_endpoint, topic=TOPIC)
    try:
        assert subscriber.catch_up() == 5
        history = subscriber.poll(0)
        live = publish_until_heard(served, subscriber)
        last = max(served.publish_page() for _ in range(5))
        live += drain(subscriber, lambda got: bool(got) and got[-1].seq == last)
    finally:
        subscriber.close()
        served.close()
    assert seqs(history) == [3, 4, 5, 6, 7] and all(carried(frame) for frame in history)
    assert seqs(history + live) == list(range(3, last + 1)) and subscriber.first_seq == 3
    assert subscriber.lost_batches == 0 and subscriber.restarts == 0


def test_catch_up_without_a_replay_endpoint_gets_nothing(raw: RawStream) -> None:
    subscriber = subscribe(raw, replay=False)
    try:
        assert subscriber.catch_up() == 0 and subscriber.poll(0) == []
    finally:
        subscriber.close()


def test_malformed_messages_are_counted_and_skipped(raw: RawStream) -> None:
    subscriber = subscribe(raw)
    bad = [
        [TOPIC.encode(), (0).to_bytes(8, "big")],  # two frames
        [TOPIC.encode(), b"\x00\x01", payload(0)],  # a 2-byte seq
        [TOPIC.encode(), (0).to_bytes(8, "big"), b"\xc1"],  # not msgpack
        [TOPIC.encode(), (0).to_bytes(8, "big"), msgspec.msgpack.encode({"ts": 1.0})],  # not a batch
    ]
    try:
        for message in bad:
            raw.xpub.send_multipart(message)
        raw.send(0)
        raw.send(1, live=False, body=b"\xc1")  # the replay holds garbage for 1
        raw.send(2)
        frames = drain(subscriber, lambda got: len(got) >= 2)
        errors = subscriber.bad_messages
    finally:
        subscriber.close()
    assert seqs(frames) == [0, 2] and subscriber.gaps == [(1, 1)]
    assert errors == 5 and subscriber.last_error and "\n" not in subscriber.last_error


def test_a_forged_seq_far_ahead_is_a_bad_message_not_a_gap(raw: RawStream) -> None:
    """A seq no publisher could have reached since the last batch (2**63, 2**64 - 1) is counted as a bad
    message and skipped: the stream goes on from where it was, nothing counted lost."""
    subscriber = subscribe(raw)
    try:
        raw.send(0)
        first = drain(subscriber, lambda got: len(got) >= 1)
        for forged in (2**63, 2**64 - 1):
            raw.xpub.send_multipart([TOPIC.encode(), forged.to_bytes(8, "big"), payload(1)])
        raw.send(1)
        raw.send(2)
        later = drain(subscriber, lambda got: len(got) >= 2)
    finally:
        subscriber.close()
    assert seqs(first) == [0] and seqs(later) == [1, 2]
    assert (subscriber.lost_batches, subscriber.gaps, subscriber.restarts) == (0, [], 0)
    assert subscriber.bad_messages == 2 and "batches past the next one due" in str(subscriber.last_error)
