"""`GET /kvscope/census` on vLLM's API server: the `vllm.endpoint_plugins` half of the probe.

vLLM loads endpoint plugins only when VLLM_PLUGINS names them (`VLLM_PLUGINS=kvscope`). The route asks
every engine (one per DP rank) for `kvscope_census`, the utility method the general plugin adds to
EngineCore (vllm.py): the census runs on the engine's thread, between steps, and answers JSON.

NOTE: no `from __future__ import annotations` here: FastAPI reads the handler's annotations as types,
and a string annotation made it treat `request` as a query parameter (a 400 for every call).
"""

from typing import Any


class KvscopeEndpoint:
    """vLLM's EndpointPlugin protocol (plugins/endpoint_plugins/interface.py)."""

    name = "kvscope"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        async def census(request: Request) -> JSONResponse:
            client = getattr(request.app.state, "kvscope_engine_client", None)
            if client is None:
                return JSONResponse(
                    {"error": {"message": "no engine behind this server", "type": "unavailable", "code": 503}},
                    status_code=503,
                )
            try:
                answers = await client.engine_core.call_utility_all_async("kvscope_census")
            except Exception as err:
                return JSONResponse(
                    {
                        "error": {
                            "message": f"kvscope census: {type(err).__name__}: {err}",
                            "type": "unavailable",
                            "code": 503,
                        }
                    },
                    status_code=503,
                )
            return JSONResponse(answers)

        app.add_api_route("/kvscope/census", census, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.kvscope_engine_client = engine_client
