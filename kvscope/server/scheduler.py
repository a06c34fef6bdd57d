"""The scheduler process of `kvscope serve`: the engine's one scheduler code path
(`Engine.step_once`, as `kvscope run` drives it), fed with requests over ZMQ.

    process = start_scheduler(spec, "ipc:///tmp/k/in", "ipc:///tmp/k/out")
    # the front: PUSH connected to the first address, PULL connected to the second; the first
    # message it receives is a StatsOut: the scheduler is ready

NOTE: sockets. The child binds both addresses (PULL on `to_scheduler`, PUSH on `to_front`), so
the front connects, before or after the child is up (ZMQ connects again until the bind
exists). A send to the front waits until the front is connected (TokenOut is never dropped);
once the process is stopping, a send that waits more than SEND_GIVE_UP_S is dropped (the
front is gone).

NOTE: the loop
    busy    take every waiting message without blocking, then one engine step
    idle    the idle leak check (once per idle point) and a StatsOut, then block on the
            sockets for at most IDLE_POLL_S
    after each step: a TokenOut per request whose output grew or that ended, the step's
    KV events, the step's PagesOut (a replica of `serve --dp-size N`: the pages its cache
    gained and lost, for the front's router), and a StatsOut when stats_interval_s has passed
    flush   FlushCacheReq (SGLang's /flush_cache): flushed at once when nothing runs or waits;
            else refused at once (timeout 0), or kept (one at a time) and flushed at the first
            idle point before its deadline, refused past it. A flush evicts every cached leaf
            (recorded as evictions), sends the KV events' AllBlocksCleared, the router its
            removed pages, and fresh stats
    stop    ShutdownReq, SIGTERM or SIGINT: new requests are refused, those in flight finish
            (ShutdownReq(abort_in_flight=True) or a second signal aborts them), the idle
            check runs, the capture closes ('finished'), exit 0. An exception: the capture
            closes 'crashed' with its line, exit 1.
    the front dies  (the parent process ends without a ShutdownReq: SIGKILL, a crash) the loop
            stops at once, nothing more is sent (no one reads it), the requests in flight are
            stored in_flight and the capture closes 'crashed' ("the HTTP front died"), exit 1:
            a killed server is never a finished run
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq

from kvscope.engine.config import EngineConfig
from kvscope.server.kv_events import AllBlocksCleared, CachedPages, KVEventPublisher, KVEventsConfig, page_deltas
from kvscope.server.protocol import (
    AbortReq,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    Logprob,
    PagesOut,
    PoolStats,
    ShutdownReq,
    StatsOut,
    TokenOut,
    decode_to_scheduler,
    encode,
)
from kvscope.telemetry import NULL_RECORDER, PoolTerms, Recorder, Routing, RunStatus

if TYPE_CHECKING:
    from kvscope.engine import ModelConfig, Req

IDLE_POLL_S = 0.05
SEND_RETRY_S = 0.2
SEND_GIVE_UP_S = 5.0
EXIT_OK, EXIT_CRASHED = 0, 1
EXIT_RECORDING_STOPPED = 4  # NOTE: as `kvscope run` and `attach`: the engine served on, its capture is incomplete
FRONT_DIED = "the HTTP front died (the kvscope serve process ended without stopping the scheduler)"


@dataclass(frozen=True)
class ServeSpec:
    engine: EngineConfig
    model: ModelConfig
    capture: str | None  # a file path or SQLAlchemy URL; None: recording off
    level: str = "full"
    label: str = "serve"
    config: dict[str, Any] = field(default_factory=dict)  # the run fingerprint stored in the capture
    retention: Any = None  # telemetry.Retention: what the run keeps of its events (None: all)
    kv_events: KVEventsConfig | None = None  # already this rank's (KVEventsConfig.for_rank)
    stats_interval_s: float = 0.5
    dp_rank: int = 0  # this replica's rank in `serve --dp-size N`
    report_pages: bool = False  # send the front a PagesOut per step that changed the cache (N > 1)


def start_scheduler(spec: ServeSpec, to_scheduler: str, to_front: str) -> BaseProcess:
    """Start the scheduler process (spawned); an impossible model/config pairing raises
    ValueError here, before any process or capture exists."""
    spec.engine.check_model(spec.model.sliding_window, spec.model.is_hybrid, spec.model)
    process = multiprocessing.get_context("spawn").Process(
        target=_child, args=(spec, to_scheduler, to_front), name="kvscope-scheduler", daemon=True
    )
    process.start()
    return process


def _child(spec: ServeSpec, to_scheduler: str, to_front: str) -> None:
    sys.exit(scheduler_main(spec, to_scheduler, to_front))


def scheduler_main(spec: ServeSpec, to_scheduler: str, to_front: str) -> int:
    """The scheduler process's body; returns its exit code."""
    stop = StopFlag()
    stop.install()
    recorder: Recorder = NULL_RECORDER
    loop: ServeLoop | None = None
    status, error = RunStatus.FINISHED, None
    try:
        if spec.capture is not None:
            from kvscope.telemetry import SQLRecorder

            recorder = SQLRecorder(
                spec.capture, level=spec.level, label=spec.label, config=spec.config, retention=spec.retention
            )
        loop = ServeLoop(spec, recorder, stop, to_scheduler, to_front)
        loop.run()
        if loop.front_died:
            status, error = RunStatus.CRASHED, FRONT_DIED
            print(f"kvscope serve: scheduler stopped: {FRONT_DIED}", file=sys.stderr)
            loop.engine.stats.close_in_flight()
    except BaseException as err:
        status, error = RunStatus.CRASHED, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        print(f"kvscope serve: scheduler crashed: {error}", file=sys.stderr)
        if loop is not None:
            loop.engine.stats.close_in_flight()
    finally:
        recorder.close(status, error)
        if loop is not None:
            loop.close()
    if status != RunStatus.FINISHED:
        return EXIT_CRASHED
    return EXIT_RECORDING_STOPPED if getattr(recorder, "failure", None) else EXIT_OK


class StopFlag:
    """SIGTERM and SIGINT: the first asks for a drain, the second for the in-flight requests' abort."""

    def __init__(self) -> None:
        self.num_signals = 0

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.num_signals += 1


@dataclass
class Flight:
    """What the front has been told of one request."""

    req: Req  # NOTE: kvscope.engine loads torch: the child imports it, the front never
    arrival_wall_s: float
    num_sent: int = 0
    queue_sent: bool = False
    prompt_logprobs: list[Logprob | None] | None = None  # sent with the first TokenOut


class ServeLoop:
    def __init__(self, spec: ServeSpec, recorder: Recorder, stop: StopFlag, to_scheduler: str, to_front: str) -> None:
        from kvscope.engine import Engine

        self.spec = spec
        self.stop = stop
        self.engine = Engine(spec.engine, spec.model, recorder)
        self.context: zmq.Context[Any] = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.bind(to_scheduler)
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDTIMEO, int(SEND_RETRY_S * 1000))
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.bind(to_front)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.publisher: KVEventPublisher | None = None
        self.pages: CachedPages | None = None
        if spec.kv_events is not None and spec.kv_events.enabled:
            self.publisher = KVEventPublisher(spec.kv_events, self.context, spec.dp_rank)
            if self.publisher.replay is not None:
                self.poller.register(self.publisher.replay, zmq.POLLIN)
        if self.publisher is not None or spec.report_pages:
            self.pages = CachedPages(self.engine.memory.cache, spec.engine.pool.page_size)
        self.flights: dict[str, Flight] = {}
        self.client_aborts: set[str] = set()
        self.draining = False
        self.abort_requested = False
        self.front_died = False
        self.last_stats_s = 0.0
        self.parent = multiprocessing.parent_process()
        self.pending_flush: tuple[FlushCacheReq, float] | None = None  # a flush waiting for idle, its deadline

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        if self.publisher is not None:
            self.publisher.publish([AllBlocksCleared()])
        self.send_stats()  # ready
        scheduler = self.engine.scheduler
        while True:
            idle = scheduler.is_idle()
            self.receive(timeout_s=IDLE_POLL_S if idle else 0.0)
            self.check_stop()
            if self.front_died:
                return
            if self.abort_requested:
                self.abort_all()
            self.check_pending_flush()  # NOTE: before a drain's exit, so a waiting flush is answered
            if self.draining and scheduler.is_idle():
                break
            self.step()
        self.engine.idle_check()
        self.engine.finish_run()
        self.send_stats()

    def step(self) -> None:
        engine = self.engine
        if engine.scheduler.is_idle():
            if engine.idle_check() or time.monotonic() - self.last_stats_s >= self.spec.stats_interval_s:
                self.send_stats()
            return
        changed = engine.step_once()
        for req in changed:
            self.send_tokens(req)
        self.publish_kv_events()
        if time.monotonic() - self.last_stats_s >= self.spec.stats_interval_s:
            self.send_stats()

    def check_stop(self) -> None:
        if self.stop.num_signals >= 1:
            self.draining = True
        if self.stop.num_signals >= 2:
            self.abort_requested = True
        if self.parent is not None and not self.parent.is_alive():
            self.front_died = self.draining = True

    # -- requests from the front ---------------------------------------------------------------

    def receive(self, timeout_s: float) -> None:
        """Every message waiting (waiting up to `timeout_s` for the first), and replay requests."""
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.publisher is not None and self.publisher.replay in ready:
            self.publisher.serve_replay()
        if self.inbox not in ready:
            return
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode_to_scheduler(frame)
            except msgspec.DecodeError as err:
                print(f"kvscope serve: scheduler ignored a message it cannot decode ({err})", file=sys.stderr)
                continue
            self.handle(msg)

    def handle(self, msg: GenerateReq | AbortReq | ShutdownReq | FlushCacheReq) -> None:
        if isinstance(msg, GenerateReq):
            self.generate(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            self.flush_or_wait(msg)
        else:
            self.draining = True
            self.abort_requested = self.abort_requested or msg.abort_in_flight

    def generate(self, msg: GenerateReq) -> None:
        from kvscope.engine.request import Req

        max_context_len = self.spec.engine.pool.max_context_len
        if self.draining:
            return self.refuse(msg.rid, "the server is shutting down")
        if msg.rid in self.flights:
            return self.refuse(msg.rid, f"request id {msg.rid!r} is already in flight")
        if len(msg.input_ids) + msg.max_new_tokens > max_context_len:  # NOTE: before Req sizes its buffer
            return self.refuse(
                msg.rid,
                f"request {msg.rid}: {len(msg.input_ids) + msg.max_new_tokens} tokens "
                f"(prompt + output) exceed the context length {max_context_len}",
            )
        try:
            req = Req(
                msg.rid,
                np.asarray(msg.input_ids, dtype=np.int32),
                msg.max_new_tokens,
                user=msg.principal,
                sampling=msg.sampling,
            )
            if min(msg.input_ids) < 0:
                raise ValueError(f"request {msg.rid}: negative token id {min(msg.input_ids)}")
            self.engine.validate(req)
            flight = Flight(req, msg.arrival_wall_s or time.time())
            if msg.num_prompt_logprobs is not None:
                flight.prompt_logprobs = self.prompt_logprobs(msg.input_ids, msg.num_prompt_logprobs)
            self.engine.submit(req)
            if msg.routing is not None:
                self.engine.stats.routed(req, Routing(*msgspec.structs.astuple(msg.routing)))
        except (ValueError, OverflowError) as err:
            return self.refuse(msg.rid, (str(err).splitlines() or ["invalid request"])[0])
        self.flights[msg.rid] = flight

    def flush_or_wait(self, msg: FlushCacheReq) -> None:
        """SGLang's flush: at once when idle; else refused (timeout 0) or kept until idle or its deadline."""
        if self.pending_flush is not None:
            return self.send(FlushCacheOut(msg.flush_id, False, "another flush_cache is already waiting"))
        if msg.timeout_s <= 0 or self.engine.scheduler.is_idle():
            return self.answer_flush(msg)
        self.pending_flush = (msg, time.monotonic() + msg.timeout_s)

    def check_pending_flush(self) -> None:
        if self.pending_flush is None:
            return
        msg, deadline = self.pending_flush
        if self.engine.scheduler.is_idle():
            self.pending_flush = None
            self.answer_flush(msg)
        elif time.monotonic() >= deadline:
            self.pending_flush = None
            self.send(FlushCacheOut(msg.flush_id, False, f"timed out after {msg.timeout_s:g} s waiting for idle"))

    def answer_flush(self, msg: FlushCacheReq) -> None:
        scheduler = self.engine.scheduler
        num_running = len(scheduler.running) + (scheduler.chunked_req is not None)
        if not self.engine.flush_cache():
            why = f"cache not flushed: {num_running} requests running, {len(scheduler.waiting)} waiting"
            return self.send(FlushCacheOut(msg.flush_id, False, why))
        self.publish_kv_events(cleared=True)
        self.send_stats()
        self.send(FlushCacheOut(msg.flush_id, True))

    def prompt_logprobs(self, input_ids: list[int], num_top: int) -> list[Logprob | None]:
        """The prompt's logprobs from one dense forward (the reference the paged path matches; a
        prefix the cache holds has no logits left to read)."""
        import torch

        from kvscope.engine.sampling import prompt_logprobs

        logits = self.engine.model.dense_forward(torch.as_tensor(input_ids, dtype=torch.int64))
        return [
            None if lp is None else Logprob(token, lp.logprob, lp.top_ids, lp.top_logprobs)
            for token, lp in zip(input_ids, prompt_logprobs(logits, input_ids, num_top), strict=True)
        ]

    def refuse(self, rid: str, error: str) -> None:
        self.send(TokenOut(rid, [], finished=True, finish_reason="error", error=error))

    def abort(self, rid: str) -> None:
        flight = self.flights.get(rid)
        if flight is None:  # unknown or already ended: nothing to do
            return
        self.client_aborts.add(rid)
        if self.engine.scheduler.abort_request(rid):
            self.send_tokens(flight.req)
            self.publish_kv_events()

    def abort_all(self) -> None:
        for rid in list(self.flights):
            self.abort(rid)

    # -- what goes to the front ----------------------------------------------------------------

    def send_tokens(self, req: Req) -> None:
        from kvscope.engine.request import ReqState

        flight = self.flights.get(req.rid)
        if flight is None:
            return
        new_ids = req.output_ids[flight.num_sent :]
        out = TokenOut(
            req.rid,
            new_ids,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output_ids),
        )
        if req.sampling.num_logprobs is not None:
            out.logprobs = [
                Logprob(token, *lp) for token, lp in zip(new_ids, req.output_logprobs[flight.num_sent :], strict=True)
            ]
        if flight.prompt_logprobs is not None:
            out.prompt_logprobs, flight.prompt_logprobs = flight.prompt_logprobs, None
        flight.num_sent = len(req.output_ids)
        if req.admitted and not flight.queue_sent:
            out.queue_s = max(0.0, time.time() - flight.arrival_wall_s)
            flight.queue_sent = True
        if req.state in (ReqState.FINISHED, ReqState.ABORTED):
            out.finished = True
            if req.state == ReqState.FINISHED:
                out.finish_reason = req.finish_reason or "length"
                out.stop_token, out.stop_sequence = req.stop_token, req.stop_sequence
            elif req.rid in self.client_aborts:
                out.finish_reason = "abort"
            else:
                out.finish_reason, out.error = "error", "aborted by the scheduler: out of KV memory"
            del self.flights[req.rid]
            self.client_aborts.discard(req.rid)
        self.send(out)

    def send_stats(self) -> None:
        engine = self.engine
        memory, scheduler, stats = engine.memory, engine.scheduler, engine.stats
        pools = {"full": pool_stats(memory.full_terms())}
        swa = memory.swa_terms()
        if swa is not None:
            pools["swa"] = pool_stats(swa)
        self.last_stats_s = time.monotonic()
        num_running = len(scheduler.running) + (scheduler.chunked_req is not None)
        self.send(
            StatsOut(
                scheduler.step,
                pools,
                num_running,
                len(scheduler.waiting),
                stats.prompt_tokens,
                stats.cached_tokens,
                stats.generated_tokens,
                stats.evicted_tokens,
                stats.num_retractions,
                stats.leak_checks_passed,
                stats.leak_checks_failed,
                None if memory.host_terms() is None else stats.host_hit_tokens,
            )
        )

    def send(self, msg: TokenOut | StatsOut | PagesOut | FlushCacheOut) -> None:
        frame = encode(msg)
        waited_s = 0.0
        while not self.front_died:
            try:
                self.outbox.send(frame)
                return
            except zmq.Again:
                waited_s += SEND_RETRY_S
                self.check_stop()
                if self.draining and waited_s >= SEND_GIVE_UP_S:
                    return  # NOTE: stopping and no front reads: the message has no one to go to

    def publish_kv_events(self, cleared: bool = False) -> None:
        """The step's cache changes: KV events when configured, a PagesOut for a replica's router.
        `cleared`: the cache was flushed, published as SGLang publishes its reset (AllBlocksCleared)."""
        if self.pages is None:
            return
        events = self.pages.diff()
        if self.publisher is not None:
            self.publisher.publish([AllBlocksCleared()] if cleared else events)
        if self.spec.report_pages and events:
            self.send(PagesOut(*page_deltas(events)))

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.inbox.close(linger=0)
        self.outbox.close(linger=0 if self.front_died else None)
        self.context.term()


def pool_stats(terms: PoolTerms) -> PoolStats:
    """SGLang's split: used = total - available - evictable (KV neither free nor reclaimable)."""
    used = terms.total - terms.available - terms.evictable
    return PoolStats(terms.total, used, terms.available, terms.evictable, terms.protected)
