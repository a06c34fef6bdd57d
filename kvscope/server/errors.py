"""The OpenAI-shaped request error of `kvscope serve`: {"error": {"message", "type", "param", "code"}},
and the boundary around every route that turns what a handler lets out into one (front.py's NOTE).
"""

from __future__ import annotations

import json
import sys
from contextlib import suppress
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ApiError(Exception):
    """A request error, answered as OpenAI's error JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type_=self.type, param=self.param, code=self.code)


def error_response(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ErrorBoundary:
    """Around every route (see the module NOTE): no exception leaves the app, so uvicorn never
    prints a traceback and no bad request is a 500."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except ClientDisconnect:
            return  # NOTE: the client went away (mid-body, mid-stream): no one to answer
        except ApiError as err:
            if not started:
                await err.response()(scope, receive, send)
        except Exception as err:
            report_internal_error(scope, err)
            if not started:
                await error_response(
                    500, f"internal error: {type(err).__name__}", type_="server_error", code="internal_error"
                )(scope, receive, send)
            else:
                with suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


def internal_error_event(scope: Scope, err: BaseException) -> str:
    """A bug met mid-stream, reported, as the stream's last event (the client sees an error, not a cut)."""
    report_internal_error(scope, err)
    error = {"message": f"internal error: {type(err).__name__}", "type": "server_error", "param": None}
    return sse({"error": {**error, "code": "internal_error"}})


def report_internal_error(scope: Scope, err: BaseException) -> None:
    """One line on stderr for a bug a request ran into (never a traceback)."""
    line = (str(err).splitlines() or [""])[0][:200]
    print(
        f"kvscope serve: internal error on {scope.get('method', '')} {scope.get('path', '')}: "
        f"{type(err).__name__}: {line!r}",
        file=sys.stderr,
        flush=True,
    )


async def http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
    return error_response(status, str(detail), code="not_found" if status == 404 else None)
