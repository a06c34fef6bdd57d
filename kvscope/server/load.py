"""A load generator for an OpenAI-compatible server: replays a workload or trace with its users
and sessions through the official `openai` client (AsyncOpenAI), and measures every request.

    plan_requests(trace)     TraceRequests -> PlannedRequests (token ids, user, the turn it follows)
    run_load(rounds, config) drive the plan against the server -> LoadReport
    summarize(report)        throughput and latency percentiles as a JSON-able dict

Each request is a streamed `/v1/completions` call (sent by the openai client, its server-sent
events read as JSON lines: the client's per-chunk objects cost ~0.5 ms of CPU each, which on a
small machine would slow the server under test) whose prompt is the request's token ids (so
the server's prefix cache sees exactly the workload's sharing) with `max_tokens` = its output
length and `user` = its user. Measured per request: time to first token (TTFT, from sending to
the first streamed chunk), the gaps between chunks (inter-token latency), end-to-end time, and
the usage the server reports (prompt, cached and completion tokens).

Sessions. A request that extends an earlier request's context (its prompt starts with that
request's prompt + forced output, as in the multi-turn, multi-tenant and branching workloads)
is the next turn of that session: it is sent only after that request finished. Everything else
is independent. NOTE: the server samples its own output, so a next turn re-sends the workload's
forced output, not what the server generated: the cache hit of a next turn covers the previous
prompt, not the previous answer.

Dispatch. `concurrency` workers take ready requests lowest plan index first. A request is ready
at its arrival time (with `rate`: Poisson or evenly spaced arrivals in plan order; without:
at once) and, for a next turn, once the previous turn finished. `duration` stops dispatching
after that many seconds (requests in flight finish); with a duration the workload repeats:
round r (seed + r, its ids prefixed "r{r}-"; a trace repeats as it is) joins whenever a worker
would otherwise wait, until the time is up. A trace's own arrival times are not used.

API keys (`keys`, a server's --api-keys file): a user's group is its id up to the first "-"
("t1-u2" -> "t1", so the multi-tenant workload's tenants stay apart; "u3" -> "u3"); groups, in
order of first appearance, take the keys in file order round-robin (group i -> key i mod K).
A request carries its group's key and, as `user`, the workload's user, which kvscope serve
reads as a narrowing of the key's principal ("tenant/keyuser/t1-u2"); a user with a "/" in it
would name another principal, so it is left out then.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvscope.server.api_keys import load_api_keys
from kvscope.workloads import TraceRequest

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MAX_CONTEXTS_PER_USER = 64  # open session contexts kept per user when finding a request's previous turn


class StreamError(RuntimeError):
    """The server reported an error inside the event stream."""


class ServerUnavailable(ConnectionError):
    """No OpenAI-compatible server answered at the URL (one line)."""


@dataclass(frozen=True)
class PlannedRequest:
    index: int  # position in the plan: dispatch order among ready requests
    rid: str
    user: str | None
    prompt_ids: list[int]
    max_tokens: int
    after: int | None = None  # the index of the request this one is the next turn of


@dataclass(frozen=True)
class ApiKey:
    key: str
    tenant: str
    user: str


@dataclass
class RequestResult:
    rid: str
    user: str | None
    ok: bool
    error: str | None = None
    start_s: float = 0.0  # from the start of the load
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class LoadConfig:
    url: str  # the server's root, e.g. http://127.0.0.1:30000 (".../v1" is accepted too)
    concurrency: int = 8
    rate: float | None = None  # requests per second; None: as fast as concurrency allows
    arrivals: str = "poisson"  # or "even"
    duration_s: float | None = None
    max_tokens: int | None = None  # overrides each request's output length
    keys: list[ApiKey] = field(default_factory=list)
    seed: int = 0
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0


@dataclass
class LoadReport:
    url: str
    model: str
    concurrency: int
    rate: float | None
    planned: int
    wall_s: float
    results: list[RequestResult]
    interrupted: bool = False
    stop_signal: int | None = None  # the signal that interrupted it (Ctrl-C: SIGINT)
    sent: int = 0  # dispatched, including requests cancelled in flight by a stop signal


def base_url(url: str) -> str:
    """The OpenAI base URL (ending in /v1) of a server root or base URL."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def plan_requests(
    requests: Sequence[TraceRequest], first_index: int = 0, rid_prefix: str = "", max_tokens: int | None = None
) -> list[PlannedRequest]:
    """The requests as a plan: token-id prompts, output lengths, and each next turn's previous turn
    (the latest earlier request of the same user whose prompt + forced output its prompt extends)."""
    plan: list[PlannedRequest] = []
    contexts: dict[str | None, list[tuple[np.ndarray, int]]] = {}
    for offset, request in enumerate(requests):
        index = first_index + offset
        prompt = request.prompt_ids
        after = None
        for context, earlier in reversed(contexts.get(request.user, [])):
            if context.size < prompt.size and np.array_equal(prompt[: context.size], context):
                after = earlier
                break
        plan.append(
            PlannedRequest(
                index, rid_prefix + request.rid, request.user, prompt.tolist(), max_tokens or request.output_len, after
            )
        )
        if request.output_ids is not None:
            own = contexts.setdefault(request.user, [])
            own.append((np.concatenate((prompt, request.output_ids)), index))
            del own[:-MAX_CONTEXTS_PER_USER]
    return plan


def arrival_offsets(num: int, rate: float | None, arrivals: str, rng: np.random.Generator) -> list[float]:
    """Gaps between consecutive arrivals: exponential (Poisson) or constant 1/rate; zeros without a rate."""
    if rate is None:
        return [0.0] * num
    if arrivals == "even":
        return [1.0 / rate] * num
    return [float(gap) for gap in rng.exponential(1.0 / rate, num)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def summarize(report: LoadReport) -> dict[str, Any]:
    """The report as JSON (the shape of `kvscope load --json`; docs in kvscope/app/load.py)."""
    done = [r for r in report.results if r.ok]
    failed = [r for r in report.results if not r.ok]
    wall = max(report.wall_s, 1e-9)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    completion = sum(r.completion_tokens for r in done)
    return {
        "url": report.url,
        "model": report.model,
        "concurrency": report.concurrency,
        "rate": report.rate,
        "interrupted": report.interrupted,
        "wall_s": report.wall_s,
        "requests": {
            "planned": report.planned,
            "sent": max(report.sent, len(report.results)),
            "completed": len(done),
            "failed": len(failed),
        },
        "first_error": next((r.error for r in failed), None),
        "throughput": {
            "requests_per_s": len(done) / wall,
            "output_tokens_per_s": completion / wall,
            "prompt_tokens_per_s": prompt / wall,
        },
        "tokens": {
            "prompt": prompt,
            "cached": cached,
            "completion": completion,
            "cache_hit_rate": cached / prompt if prompt else None,
        },
        "ttft_s": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_s": distribution([gap for r in done for gap in r.itl_s]),
        "e2e_s": distribution([r.e2e_s for r in done if r.e2e_s is not None]),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as the lines `kvscope load` prints."""
    req, thr, tok = summary["requests"], summary["throughput"], summary["tokens"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    head = "interrupted: " if summary["interrupted"] else ""
    lines = [
        f"{head}{req['completed']} of {req['planned']} requests completed, {req['failed']} failed, "
        f"in {summary['wall_s']:.2f} s at concurrency {summary['concurrency']}",
        f"throughput   {thr['requests_per_s']:.2f} req/s   {thr['output_tokens_per_s']:.1f} output tok/s   "
        f"{thr['prompt_tokens_per_s']:.1f} prompt tok/s",
    ]
    if tok["cache_hit_rate"] is not None:
        lines.append(
            f"tokens       prompt {tok['prompt']}   cached {tok['cached']} "
            f"({tok['cache_hit_rate']:.1%})   completion {tok['completion']}"
        )
    lines.append("latency (ms)     mean      p50      p90      p99      max")
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("e2e", "e2e_s")):
        d = summary[key]
        lines.append(f"  {name:<6}" + "".join(f"{ms(d[k]):>9}" for k in ("mean", "p50", "p90", "p99", "max")))
    if summary["first_error"]:
        lines.append(f"first error: {summary['first_error']}")
    return "\n".join(lines)


def read_api_keys(path: str | Path) -> list[ApiKey]:
    """The keys of an --api-keys file (api_keys.py, the same file `serve` reads), in file order."""
    return [ApiKey(key, who.tenant, who.user) for key, who in load_api_keys(path).items()]


def error_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:300]


class _Driver:
    """One load run: the plan (grown by rounds), the ready heap, the workers and the results."""

    def __init__(
        self, config: LoadConfig, rounds: Callable[[int], list[TraceRequest]], progress: TextIO | None
    ) -> None:
        self.config = config
        self.rounds = rounds
        self.progress = progress
        self.plan: dict[int, PlannedRequest] = {}  # index -> request, until it finished (long loads)
        self.num_planned = 0
        self.children: dict[int, list[int]] = {}
        self.arrival: dict[int, float] = {}  # seconds from start, until released
        self.ready: list[tuple[int, int]] = []  # (index, index) heap
        self.wakeup = asyncio.Event()
        self.results: list[RequestResult] = []
        self.unfinished = 0  # planned, not yet finished or dropped
        self.next_round = 0
        self.rounds_left = True
        self.stopping = False
        self.rng = np.random.default_rng(config.seed)
        self.clock = 0.0  # the last arrival time handed out
        self.user_keys: dict[str, int] = {}  # a user's group -> its slot among the keys
        self.start = time.perf_counter()
        self.in_flight = 0
        self.dispatched = 0

    def now(self) -> float:
        return time.perf_counter() - self.start

    def add_round(self) -> None:
        first = self.num_planned
        prefix = f"r{self.next_round}-" if self.config.duration_s is not None else ""
        requests = self.rounds(self.next_round)
        self.next_round += 1
        if self.config.duration_s is None or not requests:
            self.rounds_left = False
        planned = plan_requests(requests, first, prefix, self.config.max_tokens)
        gaps = arrival_offsets(len(planned), self.config.rate, self.config.arrivals, self.rng)
        loop = asyncio.get_running_loop()
        for request, gap in zip(planned, gaps, strict=True):
            self.clock += gap
            self.plan[request.index] = request
            self.num_planned += 1
            self.unfinished += 1
            if request.after is not None:
                self.arrival[request.index] = self.clock
                self.children.setdefault(request.after, []).append(request.index)
            else:
                self.release_at(loop, request.index, self.clock)

    def release_at(self, loop: asyncio.AbstractEventLoop, index: int, at_s: float) -> None:
        delay = at_s - self.now()
        if delay <= 0:
            self.release(index)
        else:
            loop.call_later(delay, self.release, index)

    def release(self, index: int) -> None:
        heapq.heappush(self.ready, (index, index))
        self.wakeup.set()

    def finished(self, index: int) -> None:
        self.unfinished -= 1
        loop = asyncio.get_running_loop()
        for child in self.children.pop(index, []):
            self.release_at(loop, child, self.arrival.pop(child))
        self.wakeup.set()

    def key_for(self, user: str | None) -> ApiKey | None:
        keys = self.config.keys
        if not keys:
            return None
        group = (user or "").split("-", 1)[0]
        slot = self.user_keys.setdefault(group, len(self.user_keys))
        return keys[slot % len(keys)]

    def wants_round(self) -> bool:
        """Another round of a repeating workload: when a worker would otherwise wait (nothing
        ready, or little left) and the arrivals handed out reach at most a second ahead."""
        if not self.rounds_left or self.clock > self.now() + 1.0:
            return False
        return not self.ready or self.unfinished - self.in_flight < 2 * self.config.concurrency

    async def take(self) -> PlannedRequest | None:
        """The next ready request, or None when the load is over."""
        while True:
            if self.stopping:
                return None
            if self.wants_round():
                self.add_round()
            if self.ready:
                _, index = heapq.heappop(self.ready)
                return self.plan.pop(index)
            if self.unfinished == 0 and not self.rounds_left:
                return None
            self.wakeup.clear()
            await self.wakeup.wait()

    async def worker(self, clients: list[Any], model: str) -> None:
        while (request := await self.take()) is not None:
            self.in_flight += 1
            try:
                key = self.key_for(request.user)
                client = clients[self.config.keys.index(key)] if key is not None else clients[0]
                user = request.user
                if key is not None and user is not None and "/" in user:
                    user = None
                self.dispatched += 1
                self.results.append(await self.send(client, model, request, user))
            finally:
                self.in_flight -= 1
                self.finished(request.index)

    async def send(self, client: Any, model: str, request: PlannedRequest, user: str | None) -> RequestResult:
        result = RequestResult(request.rid, request.user, ok=False, start_s=self.now())
        sent = time.perf_counter()
        last = None
        chunks = 0
        usage: dict[str, Any] | None = None
        try:
            extra: dict[str, Any] = {"user": user} if user is not None else {}
            # NOTE: the prompt travels in extra_body: the client's typed-parameter transform walks
            # a token-id list element by element (~12 ms of CPU for 300 ids); extra_body replaces
            # the body's "prompt" verbatim; ignore_eos: the output is as long as the workload asks (as
            # vLLM's and SGLang's benchmark clients send it)
            async with client.completions.with_streaming_response.create(
                model=model,
                prompt=[],
                max_tokens=request.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"prompt": request.prompt_ids, "ignore_eos": True},
                **extra,
            ) as response:
                async for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        continue  # read on to the end, so the connection goes back to the pool
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise StreamError(str(chunk["error"].get("message", chunk["error"])))
                    usage = chunk.get("usage") or usage
                    if not chunk.get("choices"):
                        continue
                    if last is None:
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1
            result.e2e_s = time.perf_counter() - sent
        except asyncio.CancelledError:
            raise
        except Exception as err:
            result.error = error_line(err)
            return result
        if usage:
            result.prompt_tokens = int(usage.get("prompt_tokens", 0))
            result.completion_tokens = int(usage.get("completion_tokens", 0))
            result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        else:
            result.prompt_tokens, result.completion_tokens = len(request.prompt_ids), chunks
        if chunks == 0:
            result.error = "the stream ended without a token"
            return result
        result.ok = True
        return result

    async def stop_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.stopping = True
        self.wakeup.set()

    async def report_progress(self) -> None:
        out = self.progress
        if out is None:
            return
        tty = out.isatty()
        period = 0.5 if tty else 10.0
        while True:
            await asyncio.sleep(period)
            ok = sum(r.ok for r in self.results)
            failed = len(self.results) - ok
            elapsed = self.now()
            line = (
                f"kvscope load: {elapsed:6.1f} s  {ok} done  {failed} failed  {self.in_flight} in flight  "
                f"{ok / max(elapsed, 1e-9):.2f} req/s"
            )
            out.write(f"\r{line}  " if tty else f"{line}\n")
            out.flush()


def make_clients(config: LoadConfig) -> list[Any]:
    import httpx2  # the HTTP library the openai client is built on
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    keys = [k.key for k in config.keys] or ["kvscope-load"]
    limits = httpx2.Limits(max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency + 4)
    timeout = httpx2.Timeout(config.timeout_s, connect=config.connect_timeout_s)
    return [
        AsyncOpenAI(
            base_url=base_url(config.url),
            api_key=key,
            max_retries=0,
            timeout=timeout,
            http_client=DefaultAsyncHttpxClient(limits=limits, timeout=timeout),
        )
        for key in keys
    ]


async def first_model(client: Any, url: str) -> str:
    """The id of the server's first model; ServerUnavailable when nothing answers at `url`."""
    from openai import APIConnectionError, APIStatusError

    try:
        page = await client.models.list()
    except APIConnectionError as err:
        cause = err.__cause__ or err
        raise ServerUnavailable(f"no server answers at {base_url(url)} ({error_line(cause)})") from None
    except APIStatusError as err:
        raise ServerUnavailable(f"{base_url(url)}/models answered {err.status_code}: {error_line(err)}") from None
    models = [m.id for m in page.data]
    if not models:
        raise ServerUnavailable(f"{base_url(url)}/models lists no model")
    return models[0]


def interrupt(report: LoadReport, workers: list[asyncio.Task[None]], signum: int) -> None:
    """A stop signal: the requests in flight are cancelled (their connections close, so the server
    aborts them) and the load ends with what finished."""
    report.interrupted = True
    report.stop_signal = report.stop_signal or signum
    for worker in workers:
        worker.cancel()


def hold_stop_signals(handler: Callable[[int], None]) -> list[tuple[int, Any]]:
    """SIGINT, SIGTERM and SIGHUP call `handler(signum)` on the running loop (those not ignored, and
    only on the main thread); returns what to restore."""
    loop = asyncio.get_running_loop()
    held: list[tuple[int, Any]] = []
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            continue
        try:
            loop.add_signal_handler(signum, handler, signum)
        except (ValueError, RuntimeError):  # not the main thread
            continue
        held.append((signum, previous))
    return held


def release_stop_signals(held: list[tuple[int, Any]]) -> None:
    loop = asyncio.get_running_loop()
    for signum, previous in held:
        loop.remove_signal_handler(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)


async def run_load_async(
    rounds: Callable[[int], list[TraceRequest]],
    config: LoadConfig,
    progress: TextIO | None = None,
    holder: list[LoadReport] | None = None,
) -> LoadReport:
    """Drive the plan (round 0, and more rounds while a duration lasts) against the server.

    `holder` receives the report before any request is sent, so an interrupted caller still
    has every result gathered so far (report.results grows in place)."""
    if config.concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {config.concurrency}")
    clients = make_clients(config)
    try:
        model = await first_model(clients[0], config.url)
        driver = _Driver(config, rounds, progress)
        report = LoadReport(config.url, model, config.concurrency, config.rate, 0, 0.0, driver.results)
        if holder is not None:
            holder.append(report)
        helpers = [asyncio.create_task(driver.report_progress())]
        if config.duration_s is not None:
            helpers.append(asyncio.create_task(driver.stop_after(config.duration_s)))
        workers = [asyncio.create_task(driver.worker(clients, model)) for _ in range(config.concurrency)]
        held = hold_stop_signals(lambda signum: interrupt(report, workers, signum))
        try:
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            release_stop_signals(held)
            for helper in helpers:
                helper.cancel()
            report.planned = driver.num_planned if config.duration_s is None else driver.dispatched
            report.sent = driver.dispatched
            report.wall_s = driver.now()
            if progress is not None and progress.isatty():
                progress.write("\n")
        return report
    finally:
        await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)


def run_load(
    rounds: Callable[[int], list[TraceRequest]], config: LoadConfig, progress: TextIO | None = sys.stderr
) -> LoadReport:
    """`run_load_async` on a new event loop. Ctrl-C (KeyboardInterrupt) returns what was gathered,
    marked interrupted (re-raised when it came before the first request)."""
    holder: list[LoadReport] = []
    start = time.perf_counter()
    try:
        return asyncio.run(run_load_async(rounds, config, progress, holder))
    except KeyboardInterrupt as stop:
        if not holder:
            raise
        report = holder[0]
        report.interrupted = True
        report.stop_signal = getattr(stop, "signum", signal.SIGINT)
        report.wall_s = time.perf_counter() - start
        report.planned = max(report.planned, len(report.results))
        return report
