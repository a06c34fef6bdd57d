"""The scheduler process, spawned for real and spoken to over real ZMQ: a request stream gets
the tokens `kvscope run`'s loop gives the same prompts; an abort gives its memory back and the
next idle leak check is clean; a request that can never run gets an error and the process goes
on serving; a shutdown (message or SIGTERM) closes the capture 'finished' with every request's row."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from kvscope.engine import Engine, EngineConfig, PoolConfig, Req, model_config
from kvscope.server.kv_events import KVEventsConfig
from kvscope.server.protocol import (
    AbortReq,
    FlushCacheOut,
    GenerateReq,
    ShutdownReq,
    StatsOut,
    TokenOut,
    ToScheduler,
    decode_to_front,
    encode,
)
from kvscope.server.scheduler import ServeSpec, start_scheduler
from kvscope.telemetry import Capture

START_TIMEOUT_S = 120.0  # a spawned child imports torch and builds the model
TIMEOUT_S = 60.0
ENGINE = EngineConfig(
    pool=PoolConfig(kv_size_tokens=2048, max_running_requests=8, max_context_len=256), device="cpu", strict=True
)
MODEL = model_config("tiny")


@dataclass
class Front:
    """The test's side of the two sockets, as the HTTP front holds them."""

    process: BaseProcess
    push: zmq.Socket[Any]
    pull: zmq.Socket[Any]
    tokens: dict[str, list[int]] = field(default_factory=dict)
    ends: dict[str, TokenOut] = field(default_factory=dict)
    outs: list[TokenOut] = field(default_factory=list)
    stats: list[StatsOut] = field(default_factory=list)
    flushes: list[FlushCacheOut] = field(default_factory=list)

    def send(self, msg: ToScheduler) -> None:
        self.push.send(encode(msg))

    def receive(self, timeout_s: float = TIMEOUT_S) -> TokenOut | StatsOut | FlushCacheOut:
        if not self.pull.poll(int(timeout_s * 1000)):
            raise AssertionError(
                f"no message from the scheduler in {timeout_s}s "
                f"(process alive: {self.process.is_alive()}, exit {self.process.exitcode})"
            )
        msg = decode_to_front(self.pull.recv())
        if isinstance(msg, StatsOut):
            self.stats.append(msg)
        elif isinstance(msg, FlushCacheOut):
            self.flushes.append(msg)
        else:
            self.outs.append(msg)
            self.tokens.setdefault(msg.rid, []).extend(msg.new_token_ids)
            if msg.finished:
                self.ends[msg.rid] = msg
        return msg

    def wait_ready(self) -> StatsOut:
        msg = self.receive(START_TIMEOUT_S)
        assert isinstance(msg, StatsOut), f"the first message should be a StatsOut, got {msg}"
        return msg

    def wait_ended(self, rids: list[str]) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not set(rids) <= set(self.ends):
            self.receive(max(0.1, deadline - time.monotonic()))

    def wait_stats(self, check: Any) -> StatsOut:
        """The next StatsOut for which check(stats) holds."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            msg = self.receive(max(0.1, deadline - time.monotonic()))
            if isinstance(msg, StatsOut) and check(msg):
                return msg

    def generate(self, rid: str, prompt: np.ndarray, max_new_tokens: int, principal: str | None = None) -> None:
        self.send(GenerateReq(rid, prompt.tolist(), max_new_tokens, principal, time.time()))

    def wait_exit(self) -> int | None:
        self.process.join(TIMEOUT_S)
        return self.process.exitcode


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """ipc:// paths must stay short (about 100 bytes): a directory straight under /tmp."""
    path = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def serve(
    short_dir: Path, capture: Path | None = None, kv_events: KVEventsConfig | None = None, engine: EngineConfig = ENGINE
) -> Iterator[Front]:
    spec = ServeSpec(
        engine=engine,
        model=MODEL,
        capture=None if capture is None else str(capture),
        config={"test": True},
        kv_events=kv_events,
        stats_interval_s=0.2,
    )
    to_scheduler, to_front = f"ipc://{short_dir}/in", f"ipc://{short_dir}/out"
    process = start_scheduler(spec, to_scheduler, to_front)
    context: zmq.Context[Any] = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    push.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.LINGER, 0)
    push.connect(to_scheduler)
    pull.connect(to_front)
    try:
        yield Front(process, push, pull)
    finally:
        if process.is_alive():
            process.kill()
        process.join(10)
        push.close()
        pull.close()
        context.term()


def prompts(seed: int, num: int, vocab: int = 500) -> list[np.ndarray]:
    """Prompts sharing a stem, so later requests hit the cache."""
    rng = np.random.default_rng(seed)
    stem = rng.integers(3, vocab, 24).astype(np.int32)
    return [
        np.concatenate((stem[: rng.integers(4, 24)], rng.integers(3, vocab, rng.integers(2, 20)))).astype(np.int32)
        for _ in range(num)
    ]


def engine_outputs(requests: list[tuple[str, np.ndarray, int]]) -> dict[str, list[int]]:
    """What `kvscope run`'s loop samples for the same prompts, in this process."""
    engine = Engine(ENGINE, MODEL)
    reqs = [Req(rid, prompt, max_new) for rid, prompt, max_new in requests]
    engine.run(reqs)
    return {r.rid: list(r.output_ids) for r in reqs}


def test_a_request_stream_gets_the_tokens_the_run_loop_samples(short_dir: Path) -> None:
    requests = [(f"r{i}", p, 4 + i) for i, p in enumerate(prompts(0, 6))]
    with serve(short_dir) as front:
        ready = front.wait_ready()
        assert ready.step == 0 and ready.pools["full"].total == 2048 and ready.pools["full"].used == 0
        for rid, prompt, max_new in requests:
            front.generate(rid, prompt, max_new, principal="acme/alice")
        front.wait_ended([rid for rid, _, _ in requests])
        front.generate("again", requests[0][1], requests[0][2])  # the same prompt, now in the cache
        front.wait_ended(["again"])
        front.send(ShutdownReq())
        assert front.wait_exit() == 0
    again = front.tokens.pop("again")
    assert front.tokens == engine_outputs(requests)
    assert again == front.tokens["r0"] and front.ends["again"].cached_tokens == len(requests[0][1]) - 1
    for rid, prompt, max_new in requests:
        end = front.ends[rid]
        assert (end.finish_reason, end.error) == ("length", None)
        assert (end.prompt_tokens, end.completion_tokens) == (len(prompt), max_new)
        queue_times = [o.queue_s for o in front.outs if o.rid == rid and o.queue_s is not None]
        assert len(queue_times) == 1 and queue_times[0] >= 0, "queue_s is sent once, with the first tokens"


def test_abort_gives_the_memory_back_and_the_next_idle_check_is_clean(short_dir: Path) -> None:
    capture = short_dir / "serve.db"
    with serve(short_dir, capture) as front:
        front.wait_ready()
        front.generate("long", prompts(1, 1)[0], 200)
        while not front.tokens.get("long"):
            front.receive()
        front.send(AbortReq("long"))
        front.wait_ended(["long"])
        idle = front.wait_stats(lambda s: s.num_running == 0 and s.num_waiting == 0 and s.leak_checks_passed >= 1)
        front.send(ShutdownReq())
        assert front.wait_exit() == 0
    end = front.ends["long"]
    assert end.finish_reason == "abort" and 0 < end.completion_tokens < 200
    assert idle.pools["full"].used == 0 and idle.pools["full"].protected == 0 and idle.leak_checks_failed == 0
    reader = Capture(capture)
    checks = reader.leak_checks(1)
    aborted_at = reader.requests(1).set_index("rid").loc["long"]
    assert aborted_at.status == "aborted"
    assert not checks.empty and checks.ok.all() and checks.step.max() >= idle.step


def test_a_request_that_can_never_run_gets_an_error_and_serving_goes_on(short_dir: Path) -> None:
    good = prompts(2, 1)[0]
    with serve(short_dir) as front:
        front.wait_ready()
        front.generate("too-long", np.arange(3, 300, dtype=np.int32), 8)
        front.generate("bad-token", np.array([3, 4, MODEL.vocab_size + 7], dtype=np.int32), 4)
        front.generate("negative", np.array([3, -1], dtype=np.int32), 4)
        front.generate("no-output", good, 0)
        front.send(GenerateReq("empty", [], 4))
        front.push.send(b"\x93not a message")
        front.generate("good", good, 5)
        front.wait_ended(["too-long", "bad-token", "negative", "no-output", "empty", "good"])
        front.generate("good-again", good, 3)
        front.wait_ended(["good-again"])
        assert front.process.is_alive()
    for rid in ("too-long", "bad-token", "negative", "no-output", "empty"):
        end = front.ends[rid]
        assert end.finish_reason == "error" and end.error and "\n" not in end.error, end
        assert front.tokens[rid] == []
    assert "context length 256" in str(front.ends["too-long"].error)
    assert "vocabulary" in str(front.ends["bad-token"].error)
    assert front.ends["good"].finish_reason == "length" and len(front.tokens["good"]) == 5
    assert front.ends["good-again"].cached_tokens > 0


def test_shutdown_finishes_in_flight_requests_and_closes_the_capture(short_dir: Path) -> None:
    capture = short_dir / "serve.db"
    rids = [f"r{i}" for i in range(4)]
    with serve(short_dir, capture) as front:
        front.wait_ready()
        for rid, prompt in zip(rids, prompts(3, 4), strict=True):
            front.generate(rid, prompt, 6, principal="acme/bob")
        front.send(ShutdownReq())
        front.wait_ended(rids)
        assert front.wait_exit() == 0
    assert all(front.ends[rid].finish_reason == "length" for rid in rids)
    reader = Capture(capture)
    run = reader.runs().iloc[0]
    assert run.status == "finished"
    rows = reader.requests(1)
    assert sorted(rows.rid) == rids and (rows.status == "finished").all()
    assert (rows.principal == "acme/bob").all() and (rows.output_len == 6).all()
    assert reader.leak_checks(1).ok.all() and reader.snapshot_steps(1)


def test_shutdown_with_abort_in_flight_aborts_them(short_dir: Path) -> None:
    capture = short_dir / "serve.db"
    with serve(short_dir, capture) as front:
        front.wait_ready()
        front.generate("slow", prompts(4, 1)[0], 220)
        while not front.tokens.get("slow"):
            front.receive()
        front.send(ShutdownReq(abort_in_flight=True))
        front.wait_ended(["slow"])
        assert front.wait_exit() == 0
    assert front.ends["slow"].finish_reason == "abort"
    reader = Capture(capture)
    assert reader.runs().iloc[0].status == "finished"
    assert list(reader.requests(1).status) == ["aborted"] and reader.leak_checks(1).ok.all()


def test_sigterm_drains_and_closes_the_capture_finished(short_dir: Path) -> None:
    capture = short_dir / "serve.db"
    with serve(short_dir, capture) as front:
        front.wait_ready()
        front.generate("r0", prompts(5, 1)[0], 4)
        front.wait_ended(["r0"])
        assert front.process.pid is not None
        os.kill(front.process.pid, signal.SIGTERM)
        assert front.wait_exit() == 0
    reader = Capture(capture)
    assert reader.runs().iloc[0].status == "finished"
    assert list(reader.requests(1).rid) == ["r0"]


def test_a_draining_scheduler_refuses_new_requests_and_still_takes_aborts(short_dir: Path) -> None:
    with serve(short_dir) as front:
        front.wait_ready()
        front.generate("slow", prompts(6, 1)[0], 220)
        while not front.tokens.get("slow"):
            front.receive()
        front.send(ShutdownReq())
        front.generate("late", prompts(6, 1)[0], 4)
        front.wait_ended(["late"])
        front.send(AbortReq("slow"))
        front.wait_ended(["slow"])
        assert front.wait_exit() == 0
    assert front.ends["late"].error == "the server is shutting down"
    assert front.ends["slow"].finish_reason == "abort"


def test_a_second_signal_aborts_what_the_first_was_draining(short_dir: Path) -> None:
    capture = short_dir / "serve.db"
    with serve(short_dir, capture) as front:
        front.wait_ready()
        front.generate("slow", prompts(8, 1)[0], 220)
        while not front.tokens.get("slow"):
            front.receive()
        assert front.process.pid is not None
        os.kill(front.process.pid, signal.SIGINT)
        os.kill(front.process.pid, signal.SIGTERM)
        front.wait_ended(["slow"])
        assert front.wait_exit() == 0
    assert front.ends["slow"].finish_reason == "abort"
    reader = Capture(capture)
    assert reader.runs().iloc[0].status == "finished" and list(reader.requests(1).status) == ["aborted"]
