"""`kvscope serve`: an OpenAI-compatible server on the engine, in SGLang's process layout.

    this process     the HTTP front (kvscope.server.front) on uvicorn: parse, authenticate,
                     tokenize, stream; /metrics, /server_info
    a child process  the scheduler (kvscope.server.scheduler): the engine, its memory and the capture
    between them     two ZMQ PUSH/PULL pairs on ipc:// sockets in a private temp dir (the scheduler binds)

NOTE: --dp-size N (SGLang's data-parallel layout): N scheduler processes, each its own engine,
memory and run in the one capture (its config's "fleet": {id, rank, size, dispatch}, one id per
start; label "serve dp R"); the front dispatches each request by --load-balance-method and sends
its Routing along. Rank r publishes KV events on the tcp:// port + r. A rank that dies is
dropped (its requests in flight fail 503) while another lives; when none is left, as below.

NOTE: the order of things
    1. the arguments, the keys file, the KV-events config, the engine config against the model
       and the machine (N ranks' pools), the listening socket and the capture (opened as its
       writers will, then closed): any error is one line, exit 2, and no scheduler has started
    2. the schedulers start; the first StatsOut of each means ready (Ctrl-C reaches the whole
       process group: the schedulers drain on it, as on the ShutdownReq that follows)
    3. uvicorn serves on the socket bound in 1; then "kvscope serve: ready on http://HOST:PORT"
    4. SIGINT, SIGTERM or SIGHUP: /health and new requests answer 503, the scheduler gets
       ShutdownReq (it finishes the requests in flight, flushes and closes the capture), uvicorn
       waits for the open responses, the scheduler is joined; one line, exit 0. A scheduler
       that dies on its own fails its requests in flight; the last one to die exits 1.
       A rank silent for RANK_SILENT_S (hung: a stopped process, a stuck kernel) is marked
       unresponsive with one line: dispatch skips it and /health reads "degraded" until it
       speaks again. At the stop its requests in flight end 503 at once and its process is
       killed (SIGTERM, then SIGKILL), so the stop never waits on it; exit 1. A scheduler stopped by a
       signal (SIGSTOP: it runs nothing until SIGCONT) counts as unresponsive at once, at the stop and
       while it is joined; one that has not exited JOIN_TIMEOUT_S after the stop is killed too. Each
       scheduler killed at the stop is one line saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscope.engine import EngineConfig, ModelConfig
    from kvscope.server.api_keys import Principal
    from kvscope.server.front import Front
    from kvscope.server.scheduler import ServeSpec

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # as kvscope.__main__'s
READY_TIMEOUT_S = 300.0
GRACEFUL_S = 30
DRAIN_S = 25  # requests in flight may finish this long; then they are aborted, before uvicorn's own limit
JOIN_TIMEOUT_S = 60.0
JOIN_POLL_S = 0.2  # NOTE: how often a join looks whether its process was stopped by a signal
# NOTE: a rank that sends nothing this long is unresponsive (it sends its stats every 0.5 s, busy or idle)
RANK_SILENT_S = 10.0
KILL_WAIT_S = 2.0  # a rank that does not answer: SIGTERM, this long, then SIGKILL (a stopped process takes only that)


@dataclass
class ServeOptions:
    engine: EngineConfig
    model: ModelConfig
    model_id: str
    host: str
    port: int
    capture: str | None
    level: str
    api_keys: dict[str, Principal] | None
    kv_events: Any  # KVEventsConfig | None
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    retention: Any = None  # telemetry.Retention (None: every event kept)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    """Everything checked before anything starts; ValueError or OSError with one line."""
    from kvscope.app.runner import default_capture_path, engine_from_args, retention_from_args
    from kvscope.server.api_keys import load_api_keys
    from kvscope.server.kv_events import KVEventsConfig

    dp_size = getattr(args, "dp_size", 1)
    if dp_size < 1:
        raise ValueError(f"--dp-size must be at least 1, got {dp_size}")
    engine, model = engine_from_args(args, serving=True)
    if dp_size > 1 and engine.torch_threads is not None and args.torch_threads is None:
        engine = replace(engine, torch_threads=max(1, engine.torch_threads // dp_size))  # the ranks share the cores
    engine.check_model(model.sliding_window, model.is_hybrid, model)
    check_ranks_fit(engine, model, dp_size)
    keys = load_api_keys(args.api_keys) if args.api_keys else None
    kv_events = KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
    if kv_events is not None:
        kv_events.check_ranks(dp_size)
    capture = None if args.level == "off" else (args.capture or default_capture_path("serve"))
    name = args.model.strip()
    model_id = f"kvscope-{name}" if re.fullmatch(r"[A-Za-z0-9._-]+", name) else "kvscope-custom"
    method = getattr(args, "load_balance_method", "round_robin")
    return ServeOptions(
        engine,
        model,
        model_id,
        args.host,
        args.port,
        capture,
        args.level,
        keys,
        kv_events,
        dp_size,
        method,
        retention_from_args(args),
    )


def check_ranks_fit(engine: EngineConfig, model: ModelConfig, dp_size: int) -> None:
    """ValueError naming both numbers when dp_size ranks' pools need more than the device has free."""
    from kvscope.engine.config import format_bytes
    from kvscope.mem import available_memory_bytes, resolve_device

    device = resolve_device(engine.device)
    available = available_memory_bytes(device)
    need_bytes = dp_size * engine.pool.pool_bytes(model.is_hybrid, model).total_bytes
    if dp_size > 1 and available is not None and need_bytes > available:
        raise ValueError(
            f"--dp-size {dp_size}: the ranks' pools need {format_bytes(need_bytes)} but {device} has "
            f"{format_bytes(available)} available; lower --dp-size or --kv-tokens"
        )


def serve_verb(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    listener = bind_listener(options.host, options.port)
    try:
        check_capture(options.capture)
    except BaseException:
        listener.close()
        raise
    from kvscope.app.runner import kv_fingerprint
    from kvscope.mem import resolve_device
    from kvscope.server.scheduler import EXIT_RECORDING_STOPPED, ServeSpec, start_scheduler
    from kvscope.telemetry.fingerprint import environment_fingerprint

    kv_events = options.kv_events if options.kv_events is not None and options.kv_events.enabled else None
    fleet_id = uuid.uuid4().hex
    config: dict[str, Any] = {
        "serve": {
            "host": options.host,
            "port": listener.getsockname()[1],
            "model_id": options.model_id,
            "api_keys": options.api_keys is not None,
            "kv_events": asdict(options.kv_events) if options.kv_events else None,
            "start": fleet_id,  # NOTE: names this start's runs (one per rank), to store their reports at the end
        },
        "engine": options.engine.fingerprint(),
        "model": asdict(options.model),
        "kv": kv_fingerprint(options.model),
        "environment": environment_fingerprint(str(resolve_device(options.engine.device))),
    }
    spec = ServeSpec(
        engine=options.engine,
        model=options.model,
        capture=options.capture,
        level=options.level,
        label="serve",
        config=config,
        kv_events=kv_events,
        retention=options.retention,
    )

    def start(rank: int, to_scheduler: str, to_front: str) -> multiprocessing.process.BaseProcess:
        return start_scheduler(rank_spec(spec, options, fleet_id, rank), to_scheduler, to_front)

    from kvscope.app.checkpointer import start_checkpointer, stop_checkpointer

    checkpointer = None if options.capture is None else start_checkpointer(options.capture, options.retention)
    try:
        code = serve(options, listener, start)
    finally:
        stop_checkpointer(checkpointer)
    if options.capture and options.level == "full" and code != EXIT_RECORDING_STOPPED:  # NOTE: run's rule
        store_reports(options.capture, fleet_id)
    return code


def store_reports(capture: str, start_id: str) -> None:
    """The leak report of each run this start recorded (one per rank), stored in the capture as `run`
    stores its own: the dashboard and `report leaks` then read it instead of replaying the events."""
    from kvscope.app.report import store_leak_report
    from kvscope.telemetry import Capture, CaptureError

    try:
        reader = Capture(capture)
        try:
            runs = [int(row.id) for row in reader.runs().itertuples() if _start_of(row.config) == start_id]
        finally:
            reader.close()
    except (CaptureError, OSError, ValueError) as err:
        print(f"kvscope serve: leak report not stored ({err})", file=sys.stderr)
        return
    for run_id in runs:
        try:
            print(f"kvscope serve: run {run_id}: {store_leak_report(capture, run_id)}", flush=True)
        except KeyboardInterrupt:  # NOTE: a stop while it replays: the run is closed already, only its report is lost
            print(f"kvscope serve: run {run_id}: leak report not stored (stopped while it was built)", flush=True)
            return


def _start_of(config: Any) -> str | None:
    try:
        found = json.loads(config) if isinstance(config, str) else config
    except ValueError:
        return None
    serve = found.get("serve") if isinstance(found, dict) else None
    return serve.get("start") if isinstance(serve, dict) else None


def check_capture(capture: str | None) -> None:
    """Open the capture as its writers will (creating its schema), so that a database that cannot
    be opened (refused, a wrong password, no such database) or a file that cannot be written is
    CaptureError with one line before any scheduler starts."""
    if capture is None:
        return
    from kvscope.telemetry.store import open_writer

    open_writer(capture).dispose()


def rank_spec(spec: ServeSpec, options: ServeOptions, fleet_id: str, rank: int) -> ServeSpec:
    """Data-parallel rank `rank`'s spec: its run's fleet keys and label, its KV-event endpoints
    (one rank: `spec` itself, as before --dp-size)."""
    if options.dp_size == 1:
        return spec
    fleet = {"id": fleet_id, "rank": rank, "size": options.dp_size, "dispatch": options.load_balance_method}
    return replace(
        spec,
        label=f"{spec.label} dp {rank}",
        config={**spec.config, "fleet": fleet},
        kv_events=None if spec.kv_events is None else spec.kv_events.for_rank(rank),
        dp_rank=rank,
        report_pages=True,
    )


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound now so a taken port is an error before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets whose protocol reads
    # IPPROTO_TCP, and they inherit it from here; with the default 0, a streamed event written
    # after the headers waited for the client's delayed ACK: ~40 ms on every reused connection
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except (OSError, OverflowError) as err:  # OverflowError: a port out of range from a library caller
        listener.close()
        raise OSError(f"cannot listen on {host}:{port}: {getattr(err, 'strerror', None) or err}") from None
    listener.listen(2048)
    listener.set_inheritable(True)
    return listener


StartScheduler = Callable[[int, str, str], multiprocessing.process.BaseProcess]  # (rank, to_scheduler, to_front)


def serve(options: ServeOptions, listener: socket.socket, start: StartScheduler) -> int:
    ipc_dir = tempfile.mkdtemp(prefix="kvscope-serve-")
    try:
        return asyncio.run(_serve(options, listener, start, ipc_dir))
    finally:
        listener.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)


async def _serve(options: ServeOptions, listener: socket.socket, start: StartScheduler, ipc_dir: str) -> int:
    import uvicorn

    from kvscope.server.front import Front, FrontState
    from kvscope.server.protocol import ShutdownReq

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:  # the front handles the signals
            yield

    state = FrontState(
        engine=options.engine,
        model=options.model,
        model_id=options.model_id,
        api_keys=options.api_keys,
        kv_events=asdict(options.kv_events) if options.kv_events else None,
        extra_info={"capture": options.capture, "level": options.level},
        load_balance_method=options.load_balance_method,
    )
    ranks = range(options.dp_size)
    to_schedulers = [f"ipc://{ipc_dir}/to_scheduler{'' if r == 0 else r}" for r in ranks]
    to_fronts = [f"ipc://{ipc_dir}/to_front{'' if r == 0 else r}" for r in ranks]
    front = Front(state, to_schedulers, to_fronts)
    front.start_readers()
    loop = asyncio.get_running_loop()
    stopped: list[str] = []
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if not stopped:
            stopped.append(signal.Signals(signum).name)
        stop.set()

    processes = [start(r, to_schedulers[r], to_fronts[r]) for r in ranks]
    for replica, process in zip(front.router.replicas, processes, strict=True):
        replica.pid = process.pid
    for each in STOP_SIGNALS:
        loop.add_signal_handler(each, on_signal, each)
    host, port = listener.getsockname()[:2]
    server: Server | None = None
    serving: asyncio.Task[None] | None = None
    code = 0
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not front.ready.is_set() and not stop.is_set():
            exited = [r for r, process in enumerate(processes) if not process.is_alive()]
            if exited or time.monotonic() > deadline:
                why = "exited" if exited else f"was not ready in {READY_TIMEOUT_S:.0f} s"
                print(f"kvscope serve: error: the scheduler process{rank_name(exited, options)} {why}", file=sys.stderr)
                return 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(front.ready.wait(), 0.2)
        if not stop.is_set():
            config = uvicorn.Config(
                front.app(), log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=GRACEFUL_S
            )
            server = Server(config)
            serving = loop.create_task(server.serve(sockets=[listener]))
            while not server.started and not serving.done() and not stop.is_set():
                await asyncio.sleep(0.02)
            if serving.done():
                serving.result()
                return 1
            shown = f"[{host}]" if ":" in host else host
            print(f"kvscope serve: ready on http://{shown}:{port}", flush=True)
        while not stop.is_set():
            if not watch_ranks(front, processes, options):
                code = 1
                break
            watch_silence(front, options)
            if serving is not None and serving.done():
                code = 1
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    finally:
        front.accepting = False
        front.mark_silent(RANK_SILENT_S)
        silent = front.router.silent_ranks()
        silent += [r for r in stopped_ranks(processes) if r not in silent]
        for rank in silent:
            front.fail_in_flight(rank, f"{front.rank_label(rank)} does not answer")
        if any(p.is_alive() for p in processes):
            with contextlib.suppress(Exception):
                await front.send(ShutdownReq(abort_in_flight=False))
        if server is not None and serving is not None:
            server.should_exit = True
            await drain(front, serving, any(p.is_alive() for p in processes), silent)
        for rank, process in enumerate(processes):
            await loop.run_in_executor(None, join_unless_stopped, process, 0.0 if rank in silent else JOIN_TIMEOUT_S)
            if process.is_alive():
                why = (
                    "is stopped (SIGSTOP)"
                    if process_stopped(process.pid)
                    else "does not answer"
                    if rank in silent
                    else f"had not exited {JOIN_TIMEOUT_S:g} s after the stop"
                )
                kept = "; its run stays running (ended without closing)" if options.capture else ""
                print(
                    f"kvscope serve: error: the scheduler process{rank_name([rank], options)} {why}: killed it{kept}",
                    file=sys.stderr,
                    flush=True,
                )
                await loop.run_in_executor(None, end_process, process)
                code = code or 1
        await front.close()
    why = f" ({stopped[0]})" if stopped else ""
    from kvscope.server.scheduler import EXIT_RECORDING_STOPPED
    from kvscope.telemetry.store import display_name

    where = f"; capture {display_name(options.capture)}" if options.capture else ""
    incomplete = [r for r, process in enumerate(processes) if process.exitcode == EXIT_RECORDING_STOPPED]
    if incomplete:  # NOTE: the server served on; the capture stops where recording did (kvscope check says where)
        where += f" (incomplete: recording stopped{rank_name(incomplete, options)})"
        code = code or EXIT_RECORDING_STOPPED
    print(f"kvscope serve: stopped{why}{where}", flush=True)
    return code


def rank_name(ranks: list[int], options: ServeOptions) -> str:
    """' of dp rank R' for a server with several ranks; '' with one."""
    return "" if options.dp_size == 1 else f" of dp rank {', '.join(map(str, ranks))}"


def watch_ranks(front: Front, processes: list[multiprocessing.process.BaseProcess], options: ServeOptions) -> bool:
    """Drop every rank whose scheduler process died since the last look (one line each); False
    when none is left."""
    for rank, (replica, process) in enumerate(zip(front.router.replicas, processes, strict=True)):
        if replica.live and not process.is_alive():
            where = rank_name([rank], options)
            live = len(front.router.live_ranks()) - 1
            rest = f"; serving on {live} of {options.dp_size} ranks" if live else ""
            print(f"kvscope serve: error: the scheduler process{where} exited{rest}", file=sys.stderr, flush=True)
            front.rank_exited(rank, f"the scheduler process{where} exited")
    return bool(front.router.live_ranks())


def watch_silence(front: Front, options: ServeOptions) -> None:
    """Mark the ranks silent for RANK_SILENT_S as unresponsive, one line each."""
    for rank in front.mark_silent(RANK_SILENT_S):
        answering = len(front.router.answering_ranks())
        rest = f"; serving on {answering} of {options.dp_size} ranks" if answering else "; no rank answers"
        print(
            f"kvscope serve: error: {front.rank_label(rank)} has not answered for {RANK_SILENT_S:g} s{rest}",
            file=sys.stderr,
            flush=True,
        )


def process_stopped(pid: int | None) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP, SIGTSTP: state T in /proc/PID/stat): it runs
    nothing until SIGCONT, so nothing it was asked will be done. False where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return False
    fields = stat.rpartition(")")[2].split()
    return bool(fields) and fields[0] in ("T", "t")


def stopped_ranks(processes: list[multiprocessing.process.BaseProcess]) -> list[int]:
    return [rank for rank, process in enumerate(processes) if process.is_alive() and process_stopped(process.pid)]


def join_unless_stopped(process: multiprocessing.process.BaseProcess, timeout_s: float) -> None:
    """Join for up to `timeout_s`, giving up as soon as the process is stopped by a signal."""
    deadline = time.monotonic() + timeout_s
    while True:
        process.join(min(JOIN_POLL_S, max(0.0, deadline - time.monotonic())))
        if not process.is_alive() or process_stopped(process.pid) or time.monotonic() >= deadline:
            return


def end_process(process: multiprocessing.process.BaseProcess) -> None:
    """SIGTERM, then SIGKILL after KILL_WAIT_S: a stopped (or hung) process takes only SIGKILL."""
    process.terminate()
    process.join(KILL_WAIT_S)
    if process.is_alive():
        process.kill()
        process.join(KILL_WAIT_S)


async def drain(front: Front, serving: asyncio.Task[None], scheduler_alive: bool, silent: list[int]) -> None:
    """Let the requests in flight finish for DRAIN_S, then abort them, so every stream ends with
    its last message before uvicorn's graceful limit (which would cancel it mid-stream). A rank
    that goes silent meanwhile with requests in flight has them ended at once and joins `silent`
    (a rank silent without any is closing its capture: it is left to finish)."""
    from kvscope.server.protocol import ShutdownReq

    try:
        deadline = time.monotonic() + DRAIN_S
        while not serving.done() and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(serving), 0.5)
            for rank in front.router.answering_ranks():
                if (
                    rank not in silent
                    and front.in_flight_on(rank)
                    and (front.silent_for_s(rank) > RANK_SILENT_S or process_stopped(front.router.replicas[rank].pid))
                ):
                    front.fail_in_flight(rank, f"{front.rank_label(rank)} does not answer")
                    silent.append(rank)
        if serving.done():
            serving.result()
            return
        raise TimeoutError
    except TimeoutError:
        if scheduler_alive:
            with contextlib.suppress(Exception):
                await front.send(ShutdownReq(abort_in_flight=True))
    except Exception:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serving, GRACEFUL_S - DRAIN_S + 5)
