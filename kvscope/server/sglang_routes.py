"""SGLang's native routes on `kvscope serve`, beside the OpenAI ones (docs/serve.md, "SGLang's own API"):

    /generate          one prompt (text or input_ids) with SGLang's sampling_params; its text,
                       output_ids and meta_info, plain or streamed (sglang_native.py checks the body)
    /health_generate   SGLang's liveness probe: a real one-token generation
    /flush_cache       every live rank drops its prefix cache, if nothing runs there

They share the front's sockets, request queues and checks (front.Front); what differs from the
OpenAI routes is the request and reply shape, kept here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvscope.engine.sampling_params import SamplingParams
from kvscope.server.api_keys import resolve_principal
from kvscope.server.body import read_json
from kvscope.server.choice import Choice
from kvscope.server.errors import ApiError, error_response, internal_error_event, sse
from kvscope.server.openai_params import ParamError
from kvscope.server.protocol import FlushCacheReq
from kvscope.server.runs import Child, Run
from kvscope.server.sglang_native import (
    HEALTH_CHECK_PREFIX,
    NativeRequest,
    finish_reason_json,
    ignored_why,
    meta_info,
    parse_generate,
)

if TYPE_CHECKING:
    from kvscope.server.front import Front

HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT
FLUSH_ANSWER_S = 10.0  # beyond a flush's own timeout, how long a rank may take to answer it


class SGLangRoutes:
    """The native routes of one front."""

    def __init__(self, front: Front) -> None:
        self.front = front

    def routes(self) -> list[Route]:
        return [
            Route("/generate", self.native_generate, methods=["POST", "PUT"]),
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/health_generate", self.health_generate, methods=["GET"]),
        ]

    async def health_generate(self, request: Request) -> Response:
        """SGLang's liveness probe: a real one-token generation (SGLang's: greedy, input_ids [0]);
        200 once it finishes, 503 if it cannot or takes longer than HEALTH_CHECK_TIMEOUT_S."""
        if not self.front.accepting:
            return error_response(503, "the server is shutting down", type_="server_error", code="shutting_down")
        child = Child(f"{HEALTH_CHECK_PREFIX}_{uuid.uuid4().hex}", 0, [0], 1, SamplingParams(), None)
        try:
            done = await asyncio.wait_for(self.one_token(child, request), HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            done = f"no token in {HEALTH_CHECK_TIMEOUT_S:g} s"
        if done is True:
            return Response(status_code=200)
        return error_response(503, f"health check failed: {done}", type_="server_error", code="unhealthy")

    async def one_token(self, child: Child, request: Request) -> bool | str:
        """True once `child` finished with its token; else why not."""
        try:
            async for out in self.front.generate(child, None, time.time(), request):
                if out.finished:
                    return out.finish_reason in ("length", "stop") or (out.error or str(out.finish_reason))
        except ApiError as err:  # no rank to dispatch to
            return err.message
        return "the client went away"

    async def flush_cache(self, request: Request) -> Response:
        """SGLang's /flush_cache?timeout=S on every live rank: 200 once each flushed its prefix
        cache; 400 when one had requests running or waiting (after waiting up to S seconds).
        With --api-keys it needs a key, as SGLang's admin-optional routes do; /health_generate not."""
        if not self.front.accepting:
            return error_response(503, "the server is shutting down", type_="server_error", code="shutting_down")
        resolve_principal(self.front.state.api_keys, request.headers.get("authorization"), None)  # 401 without a key
        try:
            timeout_s = float(request.query_params.get("timeout", "0"))
        except ValueError:
            timeout_s = -1.0
        if not 0 <= timeout_s < float("inf"):
            return error_response(
                400, "'timeout' must be a number of seconds >= 0", param="timeout", code="invalid_value"
            )
        ranks = self.front.router.live_ranks()
        loop = asyncio.get_running_loop()
        waiters = {uuid.uuid4().hex: rank for rank in ranks}
        for flush_id in waiters:
            self.front.flushes[flush_id] = loop.create_future()
        try:
            for flush_id, rank in waiters.items():
                await self.front.send(FlushCacheReq(flush_id, timeout_s), rank)
            futures = [self.front.flushes[flush_id] for flush_id in waiters]
            answers = await asyncio.wait_for(asyncio.gather(*futures), timeout_s + FLUSH_ANSWER_S)
        except TimeoutError:
            return error_response(
                503, "a scheduler did not answer the flush", type_="server_error", code="scheduler_unavailable"
            )
        finally:
            for flush_id in waiters:
                self.front.flushes.pop(flush_id, None)
        failed = [(rank, a.message) for rank, a in zip(ranks, answers, strict=True) if not a.success]
        if failed:
            lines = [message if len(ranks) == 1 else f"dp rank {rank}: {message}" for rank, message in failed]
            return error_response(400, "; ".join(lines), code="cache_not_flushed")
        return Response("Cache flushed.\n", media_type="text/plain")

    async def native_generate(self, request: Request) -> Response:
        """SGLang's /generate (sglang_native.py): one prompt; its text, output_ids and meta_info."""
        arrival = time.time()
        try:
            if not self.front.accepting:
                raise ApiError(503, "the server is shutting down", type_="server_error", code="shutting_down")
            body = await read_json(request)
            principal = resolve_principal(self.front.state.api_keys, request.headers.get("authorization"), None)
            native, child = self.parse_native(body)
        except ApiError as err:
            return err.response()
        run = Run(child, Choice(0, False, native.params, child.input_ids), echo=False)
        if native.stream:
            return StreamingResponse(
                self.native_stream(run, principal, arrival, request), media_type="text/event-stream"
            )
        outs = self.front.generate(child, principal, arrival, request)
        try:
            async for out in outs:
                if out.finish_reason == "error":
                    status, type_, code = self.front.refusal(out.rid)
                    return error_response(
                        status, out.error or "the scheduler refused the request", type_=type_, code=code
                    )
                run.take(out)
        finally:
            await outs.aclose()
        if not run.outcome.finish_reason:  # the client went away
            return error_response(499, "client closed the request", code="client_closed")
        return JSONResponse(self.native_reply(run, arrival))

    def parse_native(self, body: Any) -> tuple[NativeRequest, Child]:
        """The checked /generate request and its one scheduler request; ApiError naming the bad field."""
        tokenizer = self.front.tokenizer
        try:
            native = parse_generate(
                body, self.front.state.model.vocab_size, tokenizer.eos_id, lambda text: tokenizer.encode(text).tolist()
            )
        except ParamError as err:
            raise ApiError(400, str(err), param=err.param, code=err.code) from None
        self.front.log_ignored(native.ignored, ignored_why)
        ids = native.input_ids
        prompt_key = "text" if isinstance(body.get("text"), str) else "input_ids"
        max_tokens = native.max_new_tokens or self.front.default_max_tokens(ids, prompt_key)
        self.front.check_request(ids, max_tokens, native.params.max_key)
        if native.params.sampling.min_tokens > max_tokens:
            raise ApiError(
                400,
                f"'sampling_params.min_new_tokens' is more than the {max_tokens} tokens this prompt leaves",
                param="sampling_params.min_new_tokens",
                code="invalid_value",
            )
        rid = native.rid or uuid.uuid4().hex
        if rid in self.front.pending:
            raise ApiError(400, f"request id {rid!r} is already in flight", param="rid", code="invalid_value")
        return native, Child(rid, 0, ids, max_tokens, native.params.sampling, None)

    def native_reply(self, run: Run, arrival: float) -> dict[str, Any]:
        """SGLang's reply: the text and output_ids so far, and meta_info (finish_reason once ended)."""
        outcome, child = run.outcome, run.child
        finish = finish_reason_json(
            outcome.finish_reason, run.choice.stop_reason, child.max_tokens, self.front.tokenizer.eos_id, outcome.error
        )
        latency = None if finish is None else time.time() - arrival
        info = meta_info(child.rid, finish, outcome.prompt_tokens, len(outcome.ids), outcome.cached_tokens, latency)
        return {"text": run.text, "output_ids": list(outcome.ids), "meta_info": info}

    async def native_stream(
        self, run: Run, principal: str | None, arrival: float, request: Request
    ) -> AsyncIterator[str]:
        """SGLang's stream: one event per scheduler message, each with everything so far, then [DONE]."""
        outs = self.front.generate(run.child, principal, arrival, request)
        try:
            async for out in outs:
                if out.finish_reason == "error":
                    _, type_, code = self.front.refusal(out.rid)
                    message = out.error or "the scheduler refused the request"
                    yield sse({"error": {"message": message, "type": type_, "param": None, "code": code}})
                    break
                run.take(out)
                yield sse(self.native_reply(run, arrival))
        except Exception as err:  # NOTE: a bug mid-stream: the stream ends with an error event, not cut
            yield internal_error_event(request.scope, err)
        finally:
            await outs.aclose()
        yield "data: [DONE]\n\n"
