"""One of vLLM's API servers with --api-server-count > 1, in the vLLM venv, without an engine: vLLM 0.32's
own build_app (its routes, /metrics included, and the endpoint plugins VLLM_PLUGINS names) with
PROMETHEUS_MULTIPROC_DIR set, as vLLM sets it for several API servers; then the endpoint plugins' state
with an engine client whose kvscope_metrics answers the tally of two real censuses (the second names a
leaked block). The process adds INDEX + 1 to a counter of its own in the multiprocess files (as each API
server counts its own requests in vllm:* series), waits until every other API server did, scrapes its
own GET /metrics in process (the poll task running, as in a server) and prints the kvscope_probe_*
samples and the counter's sum as JSON.

    python vllm_metrics_driver.py INDEX COUNT     (env: PROMETHEUS_MULTIPROC_DIR, KVSCOPE_CAPTURE, VLLM_PLUGINS)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvscope.probe.census import TERMS, BlockView, take_census
from kvscope.probe.metrics import CensusTally

COUNTER = "vllm:kvscope_test_api_server_requests"
WAIT_S = 300.0  # NOTE: for the other API servers' starts (vLLM's imports take a minute on a loaded machine)


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.is_null = block_id, False


def tally() -> CensusTally:
    """Two real censuses of a 3-block pool: clean (busy), then block 2 held by no table (busy)."""
    counted = CensusTally()
    for step, refs in ((5, {1: 1, 2: 0, 3: 0}), (9, {1: 1, 2: 1, 3: 0})):
        queued = [b for b, ref in refs.items() if ref == 0]
        view = BlockView(refs, set(), queued, len(queued))
        counted.note(step, take_census(view, [{"a": [Block(1)]}], [], {"a"}, {}), TERMS, "busy")
    return counted


class EngineCore:
    """The engines behind the API server, as its client calls them: one, DP rank 0."""

    def __init__(self) -> None:
        self.snapshot = {**tally().snapshot(True, None), "dp_rank": 0}

    async def call_utility_all_async(self, method: str) -> list[Any]:
        assert method == "kvscope_metrics", method
        return [self.snapshot]


def engine_client() -> Any:
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name="soak-model"))
    return SimpleNamespace(vllm_config=config, engine_core=EngineCore())


def count_requests(index: int, count: int) -> None:
    """This API server's own counter; then every API server's (each leaves a file when it counted)."""
    from prometheus_client import Counter

    Counter(COUNTER, "requests this API server answered").inc(index + 1)
    folder = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    (folder / f"counted-{index}").touch()
    deadline = time.monotonic() + WAIT_S
    while len(list(folder.glob("counted-*"))) < count:
        assert time.monotonic() < deadline, "the other API servers never counted"
        time.sleep(0.2)


async def scrape(index: int, count: int) -> str:
    import httpx
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.plugins.endpoint_plugins.interface import init_endpoint_plugins_state
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--api-server-count", str(count)])
    app = build_app(args, ("generate",))
    await init_endpoint_plugins_state(engine_client(), app.state, args)
    count_requests(index, count)
    await asyncio.sleep(0.5)  # NOTE: the poll task's first answer
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
        response = await client.get("/metrics")
    assert response.status_code == 200, response.text
    return response.text


def main() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    index, count = int(sys.argv[1]), int(sys.argv[2])
    text = asyncio.run(scrape(index, count))
    samples = [
        {"name": s.name, "labels": s.labels, "value": s.value}
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvscope_probe_") or s.name.startswith(COUNTER)
    ]
    print(json.dumps(samples))


if __name__ == "__main__":
    main()
