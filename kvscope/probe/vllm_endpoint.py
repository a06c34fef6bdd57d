"""`GET /kvscope/census` and the `kvscope_probe_*` series of `/metrics` on vLLM's API server: the
`vllm.endpoint_plugins` half of the probe.

vLLM loads endpoint plugins only when VLLM_PLUGINS names them (`VLLM_PLUGINS=kvscope`). The route asks
every engine (one per DP rank) for `kvscope_census`, the utility method the general plugin adds to
EngineCore (vllm.py): the census runs on the engine's thread, between steps, and answers JSON.

NOTE: /metrics (the series: kvscope/probe/metrics.py). The census runs in the EngineCore process, the
registry vLLM serves is the API server's: a task on the server's event loop asks every engine for
`kvscope_metrics` (the stored censuses' tally: a dict, no census) every POLL_INTERVAL_S, awaiting the
answer (never blocking the loop; at most POLL_TIMEOUT_S, then the engine reads kvscope_probe_up 0), and
keeps the last answers; a Collector in prometheus_client's default registry turns them into series at
each scrape (the age computed then). Labelled as vLLM's own vllm:* series: model_name (the served
model name) and engine (the engine's DP rank).
NOTE: --api-server-count > 1 (PROMETHEUS_MULTIPROC_DIR set): each API server's GET /metrics builds a fresh
registry of prometheus_client's MultiProcessCollector alone (vLLM's own series, summed from every process's
files) at each scrape, so no registered Collector is served. The plugin then puts its own GET /metrics route
before vLLM's: the same multiprocess registry plus this process's Collector. Every API server polls the
engines itself, so each serves the series with the engines' values (each its own poll, at most
POLL_INTERVAL_S apart). Without vLLM's route to stand before, one line at start says the series are absent.

NOTE: no `from __future__ import annotations` here: FastAPI reads the handler's annotations as types,
and a string annotation made it treat `request` as a query parameter (a 400 for every call).
"""

import asyncio
import os
import sys
import time
from typing import Any

from kvscope.probe.metrics import families

POLL_INTERVAL_S = 2.0
POLL_TIMEOUT_S = 10.0


class EngineMetrics:
    """The engines' last `kvscope_metrics` answers, kept by the poll task, read at each scrape."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshots: dict[tuple[str, ...], dict[str, Any] | None] = {}
        self.up: dict[tuple[str, ...], bool] = {}

    def take(self, answers: list[Any]) -> None:
        for answer in answers:
            labels = (self.model_name, str(answer.get("dp_rank", 0)))
            self.snapshots[labels] = answer
            self.up[labels] = True

    def lost(self) -> None:
        """The last poll got no answer: every engine known reads down (its values stay)."""
        self.up = dict.fromkeys(self.snapshots, False)
        if not self.snapshots:
            self.snapshots[(self.model_name, "0")] = None
            self.up[(self.model_name, "0")] = False

    async def poll(self, engine_core: Any) -> None:
        """Until the server's event loop ends (the task is cancelled with it), or an engine fails the
        call: it has no kvscope_metrics (the probe refused its version) or it is gone, and vLLM would log
        each failed call's traceback: asked no more, it reads down."""
        while True:
            try:
                answers = await asyncio.wait_for(engine_core.call_utility_all_async("kvscope_metrics"), POLL_TIMEOUT_S)
            except TimeoutError:  # NOTE: busy past the timeout, or hung: down until it answers again
                self.lost()
            except Exception as err:
                self.lost()
                print(f"kvscope: /metrics: the engine failed kvscope_metrics, asked no more: {err}", file=sys.stderr)
                return
            else:
                self.take(answers)
            await asyncio.sleep(POLL_INTERVAL_S)

    def collect(self) -> Any:
        """prometheus_client's Collector protocol: the series now."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["model_name", "engine"]
        # NOTE: copies: a scrape runs on a worker thread while the poll task replaces the answers
        for family in families(dict(self.snapshots), dict(self.up), time.time()):
            make = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            metric = make(family.name, family.help, labels=[*labels, *family.extra])
            for values, value in family.samples:
                metric.add_metric(list(values), value)
            yield metric


def start_metrics(engine_client: Any, state: Any) -> None:
    """The poll task and the Collector, once per API server process (none while the probe is inert:
    KVSCOPE_CAPTURE unset)."""
    from prometheus_client import REGISTRY

    if not os.environ.get("KVSCOPE_CAPTURE"):
        return

    served = engine_client.vllm_config.model_config.served_model_name
    metrics = state.kvscope_metrics = EngineMetrics(str(served))
    state.kvscope_poll = asyncio.get_running_loop().create_task(metrics.poll(engine_client.engine_core))
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        REGISTRY.register(metrics)  # NOTE: else served by multiprocess_metrics's route (attach_router)


def multiprocess_text(state: Any) -> bytes:
    """/metrics with vLLM's multiprocess registry (--api-server-count > 1): what vLLM's own route serves
    (a MultiProcessCollector over every process's files, made per scrape, as vLLM makes it) and this API
    server's kvscope_probe_* series (state.kvscope_metrics, once the engine client is there)."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    ours = getattr(state, "kvscope_metrics", None)
    if ours is not None:
        registry.register(ours)
    return generate_latest(registry)


def serve_multiprocess_metrics(app: Any) -> bool:
    """A GET /metrics route serving multiprocess_text, put before vLLM's first /metrics route (routes
    match in order); False when vLLM has none (nothing then serves the series)."""
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.requests import Request
    from starlette.responses import Response

    def metrics(request: Request) -> Response:  # NOTE: sync, as vLLM's: the files are read on a worker thread
        return Response(content=multiprocess_text(request.app.state), headers={"Content-Type": CONTENT_TYPE_LATEST})

    routes = app.router.routes
    first = next((i for i, route in enumerate(routes) if getattr(route, "path", None) == "/metrics"), None)
    if first is None:
        return False
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    routes.insert(first, routes.pop())
    return True


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
        multiprocess = os.environ.get("KVSCOPE_CAPTURE") and os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if multiprocess and not serve_multiprocess_metrics(app):
            print(
                "kvscope: vLLM serves no /metrics route here: the kvscope_probe_* series are not served",
                file=sys.stderr,
                flush=True,
            )

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.kvscope_engine_client = engine_client
        if engine_client is not None:
            start_metrics(engine_client, state)
