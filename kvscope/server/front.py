"""The HTTP front of `kvscope serve`: parses, authenticates, tokenizes, streams (Starlette on uvicorn).

    client --HTTP--> Front --GenerateReq/AbortReq--> scheduler process (ZMQ PUSH)
    client <--SSE--- Front <--TokenOut/StatsOut----- scheduler process (ZMQ PULL)

One background task per scheduler (`read_rank`) reads its socket: a TokenOut goes to its
request's asyncio queue, a StatsOut to the metrics and the router, a PagesOut to the router's
page index of that rank. Each handler sends one GenerateReq per choice (n per prompt;
parameters checked by openai_params.py, sampled by the scheduler), then reads their queues
until the TokenOuts that finish them (choice.py turns them into text and logprobs). A client
that goes away (a closed stream, or a disconnect while a plain response is pending) makes the
handler send AbortReq for each choice still running.

A request's principal comes from its API key and `user` (api_keys.resolve_principal). The SGLang
native routes (/generate, /health_generate, /flush_cache) are sglang_routes.py's, on the same
sockets and queues. Every request error is OpenAI-shaped: {"error": {"message", "type", "param", "code"}}.

NOTE: bad input never reaches a handler as a Python surprise
    the body     read_json (body.py): not JSON, not UTF-8, NaN / Infinity / 1e999, an integer longer than
                 MAX_INT_DIGITS, nesting deeper than MAX_JSON_DEPTH, a lone UTF-16 surrogate
                 ("\\ud800", which no text encoding carries) in any string or key: 400 naming
                 the field's path (e.g. "messages[0].content")
    a handler    errors.ErrorBoundary (around every route): an ApiError it lets out is its JSON error;
                 a client gone while sending its body ends quietly; anything else is one line on
                 stderr and a 500 (a bug, never a traceback); a stream already started ends
    the scheduler dead: its requests in flight end 503 server_error (a server fault, not the
                 request's)

NOTE: data-parallel ranks (`serve --dp-size N`, docs/serve.md)
    N scheduler processes, a socket pair each; the front's Router (router.py: the loads, the
    pages each rank holds, the Dispatcher) picks the rank of each choice, and every routed
    request carries Routing(method, cached on the chosen rank, most cached on another) to its
    requests row. A rank whose process died: its requests in flight end 503, dispatch skips it,
    /health reads "degraded" (200) while another rank lives; with none left, as one scheduler dead.
    A rank that sends nothing for a bound (mark_silent; every rank sends its stats twice a second)
    is unresponsive: dispatch skips it and /health reads "degraded" until its next message; its
    requests in flight wait for it (or for the stop, which ends them 503).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import kvscope
from kvscope.engine import EngineConfig, ModelConfig
from kvscope.fleet.dispatch import DispatchError
from kvscope.server.api_keys import Principal, resolve_principal
from kvscope.server.body import read_json
from kvscope.server.chat import ChatError, render_chat
from kvscope.server.choice import Choice, Piece, render_logprobs
from kvscope.server.errors import ApiError, ErrorBoundary, error_response, http_error, internal_error_event, sse
from kvscope.server.metrics import ServerMetrics
from kvscope.server.openai_params import (
    IGNORED,
    MAX_CHOICES,
    MAX_PROMPTS,
    ParamError,
    parse_params,
)
from kvscope.server.protocol import (
    AbortReq,
    FlushCacheOut,
    GenerateReq,
    PagesOut,
    RouteInfo,
    StatsOut,
    TokenOut,
    ToScheduler,
    decode_to_front,
    encode,
)
from kvscope.server.router import Router
from kvscope.server.runs import Child, GenRequest, Run, usage, usage_so_far
from kvscope.server.sglang_routes import SGLangRoutes
from kvscope.workloads.tokenizer import ByteTokenizer

DISCONNECT_POLL_S = 0.2
BROADCAST_WAIT_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT
FLUSH_ANSWER_S = 10.0  # beyond a flush's own timeout, how long a rank may take to answer it
MAX_IGNORED_LOGGED = 64  # NOTE: distinct ignored field names logged; a client inventing names cannot fill the log


@dataclass
class FrontState:
    """What the front knows about the engine, for checks and /server_info."""

    engine: EngineConfig
    model: ModelConfig
    model_id: str
    api_keys: dict[str, Principal] | None = None
    kv_events: dict[str, Any] | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    load_balance_method: str = "round_robin"  # kvscope.fleet.DISPATCH_METHODS; with one rank, moot


@dataclass
class Pending:
    queue: asyncio.Queue[TokenOut]
    arrival_s: float
    rank: int = 0


@dataclass
class Link:
    """The socket pair to one scheduler process (a data-parallel rank)."""

    push: zmq.asyncio.Socket
    pull: zmq.asyncio.Socket


class Front:
    """The sockets to the scheduler, the per-request queues and the HTTP app."""

    def __init__(self, state: FrontState, to_scheduler: str | list[str], to_front: str | list[str]) -> None:
        """`to_scheduler`, `to_front`: one address each per data-parallel rank (a str: one rank)."""
        to_schedulers = [to_scheduler] if isinstance(to_scheduler, str) else to_scheduler
        to_fronts = [to_front] if isinstance(to_front, str) else to_front
        self.state = state
        self.tokenizer = ByteTokenizer()
        self.ignored_seen: set[str] = set()
        self.metrics = ServerMetrics(
            state.engine.pool.page_size, state.model_id, len(to_schedulers), state.engine.cache.kind
        )
        self.context = zmq.asyncio.Context()
        self.links = [self.connect(a, b) for a, b in zip(to_schedulers, to_fronts, strict=True)]
        self.router = Router(state.load_balance_method, len(self.links), state.engine.pool.page_size)
        self.pending: dict[str, Pending] = {}
        self.accepting = True
        self.ready = asyncio.Event()
        self.readers: list[asyncio.Task[None]] = []
        self.aborts: set[asyncio.Task[None]] = set()
        self.scheduler_error: str | None = None  # set once every scheduler process is gone
        self.lost: set[str] = set()  # requests ended by their rank's death, until their handler answers
        self.heard_at_s = [time.monotonic()] * len(self.links)  # each rank's last message (monotonic)
        self.flushes: dict[str, asyncio.Future[FlushCacheOut]] = {}  # /flush_cache answers awaited, by flush id

    def connect(self, to_scheduler: str, to_front: str) -> Link:
        push = self.context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.connect(to_scheduler)
        pull = self.context.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.connect(to_front)
        return Link(push, pull)

    @property
    def stats(self) -> StatsOut | None:
        """Rank 0's latest counters."""
        return self.router.replicas[0].stats

    # --- the scheduler side

    def start_readers(self) -> None:
        loop = asyncio.get_running_loop()
        self.readers = [loop.create_task(self.read_rank(rank)) for rank in range(len(self.links))]

    async def read_rank(self, rank: int) -> None:
        link = self.links[rank]
        while True:
            frame = await link.pull.recv()
            self.heard(rank)
            msg = decode_to_front(frame)
            if isinstance(msg, StatsOut):
                self.took_stats(rank, msg)
            elif isinstance(msg, PagesOut):
                self.router.took_pages(rank, msg)
            elif isinstance(msg, FlushCacheOut):
                waiter = self.flushes.get(msg.flush_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
            else:
                pending = self.pending.get(msg.rid)
                if pending is not None:
                    pending.queue.put_nowait(msg)

    def heard(self, rank: int) -> None:
        """A message from `rank`: it answers (again, with a line, if it was marked silent)."""
        self.heard_at_s[rank] = time.monotonic()
        replica = self.router.replicas[rank]
        if not replica.answering:
            replica.answering = True
            print(f"kvscope serve: {self.rank_label(rank)} answers again", file=sys.stderr, flush=True)

    def mark_silent(self, bound_s: float) -> list[int]:
        """Mark every live rank that has sent nothing for `bound_s` as not answering; the ranks
        newly marked."""
        newly = []
        for rank, replica in enumerate(self.router.replicas):
            if replica.live and replica.answering and self.silent_for_s(rank) > bound_s:
                replica.answering = False
                newly.append(rank)
        return newly

    def silent_for_s(self, rank: int) -> float:
        """Seconds since `rank` last sent anything."""
        return time.monotonic() - self.heard_at_s[rank]

    def rank_label(self, rank: int) -> str:
        return "the scheduler process" + ("" if len(self.links) == 1 else f" of dp rank {rank}")

    def took_stats(self, rank: int, stats: StatsOut) -> None:
        self.router.took_stats(rank, stats)
        self.metrics.update(stats, rank)
        if self.router.all_reported:
            self.ready.set()

    async def send(self, msg: ToScheduler, rank: int | None = None) -> None:
        """To the scheduler of `rank`; None: to every live one, waiting at most BROADCAST_WAIT_S
        on each (a rank that already stopped takes nothing)."""
        if rank is not None:
            if self.router.replicas[rank].live:
                await self.links[rank].push.send(encode(msg))
            return
        for link, replica in zip(self.links, self.router.replicas, strict=True):
            if replica.live:
                with suppress(TimeoutError):
                    await asyncio.wait_for(link.push.send(encode(msg)), BROADCAST_WAIT_S)

    def scheduler_exited(self, error: str) -> None:
        """Every scheduler process is gone: no new request is taken, and those in flight end with
        `error` (a 503: the server's fault, not the request's)."""
        self.scheduler_error = error
        self.accepting = False
        for rank in range(len(self.links)):
            self.rank_exited(rank, error)

    def rank_exited(self, rank: int, error: str) -> None:
        """The scheduler of `rank` is gone: dispatch skips it and its requests in flight end with
        `error` (503); the last one gone is scheduler_exited."""
        self.router.rank_exited(rank)
        self.metrics.rank_died(rank)
        self.fail_in_flight(rank, error)
        if self.scheduler_error is None and not self.router.live_ranks():
            self.scheduler_exited(error)

    def in_flight_on(self, rank: int) -> bool:
        return any(pending.rank == rank for pending in self.pending.values())

    def fail_in_flight(self, rank: int, error: str) -> None:
        """End the requests in flight on `rank` with `error` (503: the server's fault)."""
        for rid, pending in list(self.pending.items()):
            if pending.rank == rank:
                self.lost.add(rid)
                pending.queue.put_nowait(TokenOut(rid, [], finished=True, finish_reason="error", error=error))

    def refusal(self, rid: str) -> tuple[int, str, str]:
        """A request that ended in error: (status, type, code); 503 when its scheduler is gone."""
        if self.scheduler_error is not None or rid in self.lost:
            self.lost.discard(rid)
            return 503, "server_error", "scheduler_unavailable"
        return 400, "invalid_request_error", "rejected"

    def dispatch(self, input_ids: list[int]) -> tuple[int, RouteInfo | None]:
        """The rank for a prompt and what the router saw (None with one rank); ApiError 503 when
        no rank lives."""
        try:
            return self.router.choose(input_ids)
        except DispatchError as err:
            raise ApiError(503, str(err), type_="server_error", code="scheduler_unavailable") from None

    async def close(self) -> None:
        for reader in self.readers:
            reader.cancel()
        for link in self.links:
            link.push.close()
            link.pull.close()
        self.context.term()

    # --- requests

    def default_max_tokens(self, input_ids: list[int], param: str) -> int:
        """The rest of the context (as vLLM), and no more than the KV pool can hold beside the prompt."""
        pool = self.state.engine.pool
        page_size = pool.page_size
        by_pool = (pool.full_size_tokens // page_size - 1) * page_size  # check_request's `need` fits
        room = min(pool.max_context_len, by_pool) - len(input_ids)
        if room < 1:
            raise ApiError(
                400,
                f"this model's maximum context length is {min(pool.max_context_len, by_pool)} "
                f"tokens; the prompt has {len(input_ids)}, which leaves no room for output",
                param=param,
                code="context_length_exceeded",
            )
        return room

    def check_request(self, input_ids: list[int], max_tokens: int, param: str = "max_tokens") -> None:
        """A request that can never run is a 400 before the scheduler sees it (as Engine.check_request)."""
        pool = self.state.engine.pool
        total = len(input_ids) + max_tokens
        if total > pool.max_context_len:
            raise ApiError(
                400,
                f"this model's maximum context length is {pool.max_context_len} tokens; the "
                f"request has {len(input_ids)} prompt tokens and {param} {max_tokens}",
                param=param,
                code="context_length_exceeded",
            )
        need = -(-total // pool.page_size) * pool.page_size + pool.page_size
        if need > pool.full_size_tokens:
            raise ApiError(
                400,
                f"the request needs {need} KV tokens; the pool holds {pool.full_size_tokens}",
                param=param,
                code="context_length_exceeded",
            )

    async def generate(
        self, child: Child, principal: str | None, arrival_wall_s: float, request: Request
    ) -> AsyncGenerator[TokenOut, None]:
        """The scheduler's TokenOuts for one choice; aborts it when the caller stops early."""
        rid = child.rid
        rank, routing = self.dispatch(child.input_ids)
        pending = Pending(asyncio.Queue(), time.monotonic(), rank)
        latency = self.metrics.latency(rank)
        self.pending[rid] = pending
        finished = False
        first_token_s = last_token_s = None
        try:
            await self.send(
                GenerateReq(
                    rid,
                    child.input_ids,
                    child.max_tokens,
                    principal,
                    arrival_wall_s,
                    child.sampling,
                    child.num_prompt_logprobs,
                    routing,
                ),
                rank,
            )
            next_poll = time.monotonic() + DISCONNECT_POLL_S
            while not finished:
                try:
                    out = await asyncio.wait_for(pending.queue.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    out = None
                now = time.monotonic()
                if now >= next_poll:  # tokens may arrive faster than the poll: check on the clock
                    next_poll = now + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        return
                if out is None:
                    continue
                if out.queue_s is not None and first_token_s is None:
                    latency.queue_time.observe(out.queue_s)
                if out.new_token_ids:
                    if first_token_s is None:
                        first_token_s = now
                        latency.ttft.observe(now - pending.arrival_s)
                    elif last_token_s is not None:
                        gap = (now - last_token_s) / len(out.new_token_ids)
                        for _ in out.new_token_ids:
                            latency.itl.observe(gap)
                    last_token_s = now
                finished = out.finished
                if finished:
                    latency.e2e.observe(now - pending.arrival_s)
                    self.metrics.request_finished(out.finish_reason or "unknown", rank)
                yield out
        finally:  # NOTE: no await here, so a cancelled stream still runs it to the end
            self.pending.pop(rid, None)
            self.router.finished(rank, len(child.input_ids))
            if not finished:
                self.metrics.request_finished("abort", rank)
                task = asyncio.get_running_loop().create_task(self.send(AbortReq(rid), rank))
                self.aborts.add(task)
                task.add_done_callback(self.aborts.discard)

    async def outputs(
        self, children: list[Child], req: GenRequest, request: Request
    ) -> AsyncGenerator[tuple[int, TokenOut], None]:
        """(position in `children`, TokenOut) of every choice as they come; one choice is read
        directly, several through one queue fed by a task each (closing this aborts them all)."""
        if len(children) == 1:
            outs = self.generate(children[0], req.principal, req.arrival_wall_s, request)
            try:
                async for out in outs:
                    yield 0, out
            finally:
                await outs.aclose()
            return
        queue: asyncio.Queue[tuple[int, TokenOut | None]] = asyncio.Queue()

        async def pump(k: int, child: Child) -> None:
            outs = self.generate(child, req.principal, req.arrival_wall_s, request)
            try:
                async for out in outs:
                    queue.put_nowait((k, out))
            finally:  # NOTE: no await: a cancelled pump still reports its end
                queue.put_nowait((k, None))

        tasks = [asyncio.get_running_loop().create_task(pump(k, c)) for k, c in enumerate(children)]
        try:
            num_open = len(tasks)
            while num_open:
                k, maybe = await queue.get()
                if maybe is None:
                    num_open -= 1
                    continue
                yield k, maybe
        finally:
            for task in tasks:
                task.cancel()

    # --- HTTP

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            *SGLangRoutes(self).routes(),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
        ]
        return Starlette(
            routes=routes, middleware=[Middleware(ErrorBoundary)], exception_handlers={HTTPException: http_error}
        )

    async def health(self, request: Request) -> Response:
        if not self.accepting:
            return error_response(503, "the server is shutting down", type_="server_error", code="shutting_down")
        dead, silent = self.router.dead_ranks(), self.router.silent_ranks()
        if not dead and not silent:
            return JSONResponse({"status": "ok"})
        status = {"status": "degraded", "live_dp_ranks": self.router.answering_ranks(), "dead_dp_ranks": dead}
        return JSONResponse(status | ({"unresponsive_dp_ranks": silent} if silent else {}))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.state.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "kvscope",
            "root": self.state.model_id,
            "parent": None,
            "max_model_len": self.state.engine.pool.max_context_len,
        }

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.state.model_id:
            return self.no_such_model(model_id).response()
        return JSONResponse(self.model_card())

    def no_such_model(self, model: str) -> ApiError:
        """The 404 for a model this server does not serve (GET /v1/models/{id}, a request's 'model')."""
        return ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {self.state.model_id!r}",
            param="model",
            code="model_not_found",
        )

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": kvscope.__version__})

    async def model_info(self, request: Request) -> Response:
        """SGLang's /get_model_info."""
        return JSONResponse(
            {
                "model_path": self.state.model_id,
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "kvscope-tiny-transformer",
                "architectures": ["TinyTransformer"],
            }
        )

    async def tokenize(self, request: Request) -> Response:
        """vLLM's and SGLang's /tokenize: {"prompt": text} or {"messages": [...]} -> the token ids."""
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
            if "messages" in body:
                try:
                    text = render_chat(body.get("messages"))
                except ChatError as err:
                    raise ApiError(400, str(err), param=err.param, code="invalid_value") from None
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "'prompt' must be a string", param="prompt", code="invalid_type")
                text = prompt
        except ApiError as err:
            return err.response()
        ids = self.tokenizer.encode(text).tolist()
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.state.engine.pool.max_context_len})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            ids = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ApiError(400, "'tokens' must be a list of token ids", param="tokens", code="invalid_type")
            vocab = self.state.model.vocab_size
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise ApiError(
                    400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens", code="invalid_value"
                )
        except ApiError as err:
            return err.response()
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})

    async def server_info(self, request: Request) -> Response:
        eng, model = self.state.engine, self.state.model
        pools = pools_json(self.stats)
        return JSONResponse(
            {
                "model": self.state.model_id,
                "model_shape": {
                    "vocab_size": model.vocab_size,
                    "hidden_size": model.hidden_size,
                    "num_layers": model.num_layers,
                    "num_heads": model.num_heads,
                    "num_kv_heads": model.num_kv_heads,
                    "head_dim": model.head_dim,
                    "sliding_window": model.sliding_window,
                    "swa_layer_ids": list(model.swa_layer_ids),
                    "dtype": model.dtype,
                },
                "page_size": eng.pool.page_size,
                "max_total_num_tokens": eng.pool.full_size_tokens,
                "max_running_requests": eng.pool.max_running_requests,
                "max_context_len": eng.pool.max_context_len,
                "cache": eng.cache.kind,
                "eviction_policy": eng.cache.eviction_policy,
                "chunked_prefill_size": eng.scheduler.chunked_prefill_size,
                "pools": pools,
                "kv_events": self.state.kv_events,
                "auth": self.state.api_keys is not None,
                "dp_size": len(self.router.replicas),
                "load_balance_method": self.state.load_balance_method,
                "dp_ranks": [
                    {
                        "dp_rank": rank,
                        "live": r.live,
                        "answering": r.answering,
                        "pid": r.pid,
                        "pools": pools_json(r.stats),
                    }
                    for rank, r in enumerate(self.router.replicas)
                ],
                **self.state.extra_info,
            }
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(request, chat=True)

    async def handle(self, request: Request, chat: bool) -> Response:
        arrival = time.time()
        try:
            if not self.accepting:
                raise ApiError(503, "the server is shutting down", type_="server_error", code="shutting_down")
            body = await read_json(request)
            req = self.parse(body, chat, request.headers.get("authorization"), arrival)
        except ApiError as err:
            return err.response()
        created = int(arrival)
        rid = uuid.uuid4().hex  # the scheduler's and the capture's; the response id is "cmpl-RID"
        runs = self.runs(req, rid)
        if req.stream:
            return StreamingResponse(self.stream(req, runs, request, rid, created), media_type="text/event-stream")
        outs = self.outputs([run.child for run in runs], req, request)
        try:
            async for k, out in outs:
                if out.finish_reason == "error":
                    status, type_, code = self.refusal(out.rid)
                    return error_response(
                        status, out.error or "the scheduler refused the request", type_=type_, code=code
                    )
                runs[k].take(out)
        finally:
            await outs.aclose()
        if any(not run.outcome.finish_reason for run in runs):  # the client went away
            return error_response(499, "client closed the request", code="client_closed")
        choices = [self.choice_json(run, chat) for run in runs]
        reply: dict[str, Any] = {
            "id": response_id(rid, chat),
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.state.model_id,
            "choices": choices,
            "usage": usage(runs),
        }
        if chat and req.params.return_token_ids:  # NOTE: chat has one prompt; vLLM puts its ids on the reply
            reply["prompt_token_ids"] = runs[0].child.input_ids
        return JSONResponse(reply)

    def runs(self, req: GenRequest, rid: str) -> list[Run]:
        echo = req.params.echo
        return [
            Run(child, Choice(child.index, req.chat, req.params, child.input_ids), echo) for child in req.children(rid)
        ]

    def choice_json(self, run: Run, chat: bool) -> dict[str, Any]:
        choice = run.choice
        logprobs = render_logprobs(run.entries, chat) if choice.params.num_logprobs is not None else None
        out: dict[str, Any] = {
            "index": choice.index,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "logprobs": logprobs,
        }
        if chat:
            out["message"] = {"role": "assistant", "content": run.text}
        else:
            out["text"] = run.text
        if choice.params.return_token_ids:
            if not chat:
                out["prompt_token_ids"] = run.child.input_ids
            out["token_ids"] = list(choice.ids)
        return out

    async def stream(
        self, req: GenRequest, runs: list[Run], request: Request, rid: str, created: int
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if req.chat else "text_completion"
        rid = response_id(rid, req.chat)
        wants_logprobs = req.params.num_logprobs is not None

        def chunk(
            index: int,
            text: str | None,
            piece: Piece | None = None,
            finish: str | None = None,
            stop_reason: str | int | None = None,
            role: bool = False,
            run: Run | None = None,
            ids: list[int] | None = None,
        ) -> str:
            """`ids`: the token ids this chunk carries (return_token_ids); a choice's first chunk also
            carries its prompt's ids (on the choice in completions, on the chunk in chat, as vLLM)."""
            logprobs = render_logprobs(piece.entries, req.chat) if wants_logprobs and piece is not None else None
            choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            if req.chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice["delta"] = delta
            else:
                choice["text"] = text or ""
            body = {"id": rid, "object": kind, "created": created, "model": self.state.model_id, "choices": [choice]}
            if req.params.return_token_ids and run is not None:
                first = index not in prompt_sent
                prompt_sent.add(index)
                if req.chat and role:
                    body["prompt_token_ids"] = run.child.input_ids
                elif not req.chat and first:
                    choice["prompt_token_ids"] = run.child.input_ids
                if not role:
                    choice["token_ids"] = ids or []
            if req.continuous_usage and run is not None:
                body["usage"] = usage_so_far(run)
            return sse(body)

        prompt_sent: set[int] = set()  # choices whose prompt ids were sent (return_token_ids)
        if req.chat:
            for run in runs:
                yield chunk(run.choice.index, "", role=True, run=run)
        failed = False
        outs = self.outputs([run.child for run in runs], req, request)
        try:
            async for k, out in outs:
                if out.finish_reason == "error":
                    _, type_, code = self.refusal(out.rid)
                    yield sse(
                        {
                            "error": {
                                "message": out.error or "the scheduler refused the request",
                                "type": type_,
                                "param": None,
                                "code": code,
                            }
                        }
                    )
                    break
                run = runs[k]
                piece = run.take(out)
                new_ids = list(out.new_token_ids) if req.params.return_token_ids else []
                if piece.text or (wants_logprobs and piece.entries) or new_ids:
                    yield chunk(run.choice.index, piece.text, piece, run=run, ids=new_ids)
                if out.finished:
                    yield chunk(
                        run.choice.index,
                        None if req.chat else "",
                        finish=run.choice.finish_reason,
                        stop_reason=run.choice.stop_reason,
                        run=run,
                    )
        except Exception as err:  # NOTE: a bug mid-stream: the stream ends with an error event, not cut
            yield internal_error_event(request.scope, err)
            failed = True
        finally:
            await outs.aclose()
        if req.include_usage and not failed and all(run.outcome.finish_reason for run in runs):
            yield sse(
                {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": self.state.model_id,
                    "choices": [],
                    "usage": usage(runs),
                }
            )
        yield "data: [DONE]\n\n"

    def parse(self, body: Any, chat: bool, authorization: str | None, arrival: float) -> GenRequest:
        """A validated request, or ApiError naming the bad field."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise ApiError(400, "'user' must be a string", param="user", code="invalid_type")
        principal = resolve_principal(self.state.api_keys, authorization, user or None)
        model = body.get("model", self.state.model_id)
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model", code="invalid_type")
        if model != self.state.model_id:
            raise self.no_such_model(model)
        if chat:
            try:
                prompts = [self.tokenizer.encode(render_chat(body.get("messages"))).tolist()]
            except ChatError as err:
                raise ApiError(400, str(err), param=err.param, code="invalid_value") from None
        else:
            prompts = self.prompt_ids(body.get("prompt"))
        try:
            params = parse_params(
                body,
                chat,
                self.state.model.vocab_size,
                self.tokenizer.eos_id,
                lambda text: self.tokenizer.encode(text).tolist(),
            )
        except ParamError as err:
            raise ApiError(400, str(err), param=err.param, code=err.code) from None
        self.log_ignored(params.ignored)
        if params.truncate_prompt_tokens is not None:
            prompts = [self.truncated(ids, params.truncate_prompt_tokens) for ids in prompts]
        if len(prompts) * params.n > MAX_CHOICES:
            raise ApiError(
                400,
                f"{len(prompts)} prompts x n = {params.n} choices; at most {MAX_CHOICES} per request",
                param="n",
                code="invalid_value",
            )
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream", code="invalid_type")
        options = body.get("stream_options")
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
        for key in ("include_usage", "continuous_usage_stats"):
            if not isinstance(options.get(key, False), bool | None):
                raise ApiError(
                    400, f"'stream_options.{key}' must be a boolean", param=f"stream_options.{key}", code="invalid_type"
                )
        if options and not stream:  # NOTE: as vLLM 0.32
            raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options", code="invalid_value")
        if params.max_tokens is not None and params.max_tokens > self.state.engine.pool.max_context_len:
            raise ApiError(  # NOTE: as vLLM 0.32; a smaller max_tokens past what the prompt leaves is cut below
                400,
                f"'{params.max_key}' ({params.max_tokens}) is more than this model's context length "
                f"({self.state.engine.pool.max_context_len} tokens)",
                param=params.max_key,
                code="context_length_exceeded",
            )
        prompt_key = "messages" if chat else "prompt"
        # NOTE: as vLLM 0.32: max_tokens past the context is cut to what is left (the reply ends with 'length')
        rooms = [self.default_max_tokens(ids, prompt_key) for ids in prompts]
        max_tokens = [room if params.max_tokens is None else min(params.max_tokens, room) for room in rooms]
        for ids, limit in zip(prompts, max_tokens, strict=True):
            self.check_request(ids, limit, params.max_key)
            if params.sampling.min_tokens > limit:
                raise ApiError(
                    400,
                    f"'min_tokens' ({params.sampling.min_tokens}) is more than the {limit} tokens this prompt leaves",
                    param="min_tokens",
                    code="invalid_value",
                )
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        return GenRequest(chat, prompts, max_tokens, stream, include_usage, principal, arrival, params, continuous)

    def log_ignored(self, names: tuple[str, ...], why_of: Callable[[str], str] | None = None) -> None:
        """One line per field name the first time a request carries it (as vLLM logs ignored fields);
        `why_of`: the reason for a name (default: the OpenAI routes' IGNORED)."""
        for name in names:
            if name not in self.ignored_seen and len(self.ignored_seen) < MAX_IGNORED_LOGGED:
                self.ignored_seen.add(name)
                why = why_of(name) if why_of is not None else IGNORED.get(name, "unknown to this server")
                print(f"kvscope serve: request field {name!r} is accepted and ignored ({why})", file=sys.stderr)

    def truncated(self, ids: list[int], keep: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: the context's length)."""
        if keep == 0:
            raise ApiError(
                400, "'truncate_prompt_tokens' must be -1 or >= 1", param="truncate_prompt_tokens", code="invalid_value"
            )
        keep = self.state.engine.pool.max_context_len if keep == -1 else keep
        return ids[-keep:]

    def prompt_ids(self, prompt: Any) -> list[list[int]]:
        """The prompts of completions' `prompt`: a string, token ids, or a batch (a list) of either."""
        if prompt is None:
            raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len({type(p) for p in prompt}) > 1:  # NOTE: vLLM takes a batch of strings or of id lists, not both
                raise ApiError(400, "'prompt' mixes strings and token id lists", param="prompt", code="invalid_type")
            if len(prompt) > MAX_PROMPTS:
                raise ApiError(
                    400,
                    f"'prompt' is a batch of {len(prompt)} prompts; at most {MAX_PROMPTS} (vLLM's limit)",
                    param="prompt",
                    code="invalid_value",
                )
            return [self.one_prompt(p) for p in prompt]
        return [self.one_prompt(prompt)]

    def one_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "'prompt' is empty", param="prompt", code="invalid_value")
            ids: list[int] = self.tokenizer.encode(prompt).tolist()
            return ids
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            vocab = self.state.model.vocab_size
            bad = next((i for i in prompt if not 0 <= i < vocab), None)
            if bad is not None:
                raise ApiError(
                    400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt", code="invalid_value"
                )
            return list(prompt)
        raise ApiError(
            400,
            "'prompt' must be a string, a non-empty list of token ids, or a list of either",
            param="prompt",
            code="invalid_type",
        )


def pools_json(stats: StatsOut | None) -> dict[str, dict[str, int]]:
    pools = stats.pools if stats is not None else {}
    return {name: msgspec.structs.asdict(each) for name, each in pools.items()}


def response_id(rid: str, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + rid
