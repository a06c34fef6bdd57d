"""`kvscope serve` under load: requests/s, TTFT and end-to-end latency at concurrency 1, 16 and 64,
against the same workload through the engine directly (what `kvscope run` does) as the baseline.

    .venv/bin/python benchmarks/bench_serve.py [--num-requests N] [--rounds R] [--device cpu|cuda]
                                               [--workload NAME] [--quick] [--write | --no-write]

Prints Markdown tables; with --write (the default) also sets its rows in the `## bench_serve` table
of benchmarks/RESULTS.md.

NOTE: what runs
    server    `python -m kvscope serve --port 0 --level off --max-running-requests 64 --torch-threads 1`
              (one torch thread, as the in-process baselines; the tiny
              model, `run`'s default engine otherwise), started once; every point drives it with
              kvscope.server.load (the official openai client, streamed /v1/completions, token-id
              prompts, `user` set) at one concurrency, every request must succeed
    baseline  the same requests through a fresh Engine (level off, the same engine options but
              --max-running-requests 16), all submitted at once: engine.run() timed, not the build
    closed    the same requests through a fresh Engine (64 rows, as the server) in a closed loop of
              16 in flight, driven through Engine.step_once as the server's scheduler process does
NOTE: what is compared. "Time per request" is a point's wall time / its requests (the inverse
of throughput). The target: serve at concurrency 16 costs at most 10% more time per request
than the engine in-process driven the same way, a closed loop of 16 requests in flight with the
next one submitted as one ends: the difference is what the front, ZMQ and the client add. The
engine given all requests at once (what `kvscope run` does) is shown too; it batches many
prompts per prefill step, which no closed loop of 16 can, so it is not the target's measure.
The workload is shared-prefix by default: independent requests with no forced outputs, so both
sides sample the same number of tokens and no request waits for another.
Rounds alternate the order (baseline first, then serve 1/16/64; then the reverse), since the
machine is noisy; one untimed warm-up of each comes first.
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _results import Figure, stop_cleanly_on_sigterm, this_run, write_figures

from kvscope.app.runner import to_engine_requests
from kvscope.engine import EngineConfig, PoolConfig, model_config
from kvscope.engine.engine import Engine
from kvscope.engine.request import ReqState
from kvscope.server.load import LoadConfig, run_load, summarize
from kvscope.workloads import TraceRequest, generate

REPO = Path(__file__).resolve().parents[1]
WRITER_COMMAND = "kvscope.telemetry.writer"  # NOTE: the recorder's writer process, a child of the scheduler
CONCURRENCIES = (1, 16, 64)
COMPARED = 16
SERVER_ROWS = 64  # the server's --max-running-requests
TORCH_THREADS = 1  # the server's --torch-threads and this process's: the same engine on both sides
TARGET = 1.10
READY_TIMEOUT_S = 180.0


def start_server(device: str, level: str = "off", capture: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable,
        "-m",
        "kvscope",
        "serve",
        "--port",
        "0",
        "--level",
        level,
        "--device",
        device,
        "--max-running-requests",
        str(SERVER_ROWS),
        "--torch-threads",
        str(TORCH_THREADS),
        *(["--capture", str(capture)] if capture is not None else []),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if "ready on " in line:
            return proc, line.split("ready on ", 1)[1].strip()
    stop_server(proc)
    raise RuntimeError("kvscope serve did not become ready: " + "".join(seen[-5:]))


def stop_server(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def tree_cpu_s(pid: int, only: str | None = None) -> float:
    """User + system CPU seconds of a process and its descendants (from /proc; Linux); `only`:
    of those whose command line holds it."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    spent: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if only is not None and only not in (entry / "cmdline").read_text().replace("\0", " "):
                fields[11] = fields[12] = "0"
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        spent[int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(spent.get(p, 0.0) for p in tree)


def serve_point(url: str, trace: list[TraceRequest], concurrency: int, server_pid: int | None = None) -> dict[str, Any]:
    before, server_before = cpu_s(), tree_cpu_s(server_pid) if server_pid else 0.0
    writer_before = tree_cpu_s(server_pid, WRITER_COMMAND) if server_pid else 0.0
    report = run_load(lambda _r: trace, LoadConfig(url=url, concurrency=concurrency), progress=None)
    client_cpu_s = cpu_s() - before
    server_cpu_s = tree_cpu_s(server_pid) - server_before if server_pid else 0.0
    writer_cpu_s = tree_cpu_s(server_pid, WRITER_COMMAND) - writer_before if server_pid else 0.0
    summary = summarize(report)
    if summary["requests"]["failed"] or summary["requests"]["completed"] != len(trace):
        raise RuntimeError(f"concurrency {concurrency}: {summary['requests']}; first error: {summary['first_error']}")
    summary["per_request_s"] = report.wall_s / len(trace)
    summary["client_cpu_per_request_s"] = client_cpu_s / len(trace)
    summary["server_cpu_per_request_s"] = server_cpu_s / len(trace)
    summary["writer_cpu_per_request_s"] = writer_cpu_s / len(trace)
    return summary


def baseline_point(trace: list[TraceRequest], device: str) -> float:
    model = model_config("tiny")
    engine = Engine(EngineConfig(pool=PoolConfig(max_running_requests=COMPARED), device=device), model)
    requests = to_engine_requests(trace)
    start = time.perf_counter()
    stats = engine.run(requests)
    wall = time.perf_counter() - start
    if stats.num_finished != len(trace):
        raise RuntimeError(f"baseline finished {stats.num_finished} of {len(trace)} requests")
    return wall / len(trace)


def closed_loop_point(trace: list[TraceRequest], device: str, concurrency: int) -> dict[str, float]:
    """The engine in-process, driven as the load drives the server: `concurrency` requests in
    flight, the next one submitted the moment one ends (a closed loop). What serve adds over
    this is the front, ZMQ and the client: the issue's measure."""
    model = model_config("tiny")
    engine = Engine(EngineConfig(pool=PoolConfig(max_running_requests=SERVER_ROWS), device=device), model)
    pending = list(reversed(to_engine_requests(trace)))
    submitted_at: dict[str, float] = {}
    e2e_s: list[float] = []
    start = time.perf_counter()

    def submit() -> None:
        req = pending.pop()
        submitted_at[req.rid] = time.perf_counter()
        engine.submit(req)

    for _ in range(min(concurrency, len(pending))):
        submit()
    while len(e2e_s) < len(trace):
        for req in engine.step_once():
            if req.state in (ReqState.FINISHED, ReqState.ABORTED):
                e2e_s.append(time.perf_counter() - submitted_at[req.rid])
                if pending:
                    submit()
    wall = time.perf_counter() - start
    return {
        "per_request_s": wall / len(trace),
        "e2e_mean_s": statistics.fmean(e2e_s),
        "e2e_p50_s": statistics.median(e2e_s),
    }


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


ABOUT = (
    "`kvscope serve` (tiny model) under the openai client against the engine in-process: requests/s, "
    "latency, what the front and the client path add, and what recording at level full costs while serving."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", default="shared-prefix")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="32 requests, 1 round")
    parser.add_argument(
        "--recording",
        action="store_true",
        help="instead: what recording costs while serving, a server at --level full (capture in a "
        f"temporary directory) beside one at --level off, concurrency {COMPARED}, alternating; "
        "sets its rows in the bench_serve section",
    )
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="set its rows in the bench_serve table of benchmarks/RESULTS.md",
    )
    args = parser.parse_args()
    stop_cleanly_on_sigterm()
    if args.quick:
        args.num_requests, args.rounds = 32, 1
    torch.set_num_threads(TORCH_THREADS)
    trace = generate(args.workload, num_requests=args.num_requests, seed=0)
    if args.recording:
        recording_cost(args, trace)
        return
    load_before = os.getloadavg()[0]
    proc, url = start_server(args.device)
    points: dict[int, list[dict[str, Any]]] = {c: [] for c in CONCURRENCIES}
    baselines: list[float] = []
    closed: list[dict[str, float]] = []
    try:
        serve_point(url, trace, COMPARED)  # warm-up, untimed
        baseline_point(trace, args.device)
        closed_loop_point(trace, args.device, COMPARED)
        for r in range(args.rounds):
            steps: list[Any] = ["baseline", "closed", *CONCURRENCIES]
            for step in steps if r % 2 == 0 else reversed(steps):
                if step == "baseline":
                    baselines.append(baseline_point(trace, args.device))
                elif step == "closed":
                    closed.append(closed_loop_point(trace, args.device, COMPARED))
                else:
                    points[step].append(serve_point(url, trace, step))
                print(f"round {r + 1}/{args.rounds}: {step} done", file=sys.stderr)
    finally:
        stop_server(proc)
    load_after = os.getloadavg()[0]

    def med(values: list[float]) -> float:
        return statistics.median(values)

    base = med(baselines)
    loop_per = med([c["per_request_s"] for c in closed])
    lines = [
        f"{args.num_requests} `{args.workload}` requests (seed 0) on the tiny model, device {args.device}; "
        f"{args.rounds} rounds in alternating order, medians over rounds. Time per request = wall time / "
        "requests. Two in-process baselines, level off: the engine given every request at once (16 request "
        f"rows: `kvscope run`'s batch), and the engine in a closed loop of {COMPARED} requests in flight, the "
        f"next submitted when one ends ({SERVER_ROWS} rows, as the server), which is how the load drives serve.",
        "",
        "| point | req/s | time per request (ms) | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | e2e p99 (ms) "
        "| client CPU per request (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| engine, every request at once (`kvscope run`) | {1 / base:.1f} | {base * 1000:.2f} | - | - | - | - | - |",
        f"| engine, closed loop of {COMPARED} in-process | {1 / loop_per:.1f} | {loop_per * 1000:.2f} | - | - | "
        f"{ms(med([c['e2e_p50_s'] for c in closed]))} | - | - |",
    ]
    for c in CONCURRENCIES:
        runs = points[c]
        per = med([p["per_request_s"] for p in runs])
        lines.append(
            f"| serve, concurrency {c} | {med([p['throughput']['requests_per_s'] for p in runs]):.1f} | "
            f"{per * 1000:.2f} | {ms(med([p['ttft_s']['p50'] for p in runs]))} | "
            f"{ms(med([p['ttft_s']['p99'] for p in runs]))} | {ms(med([p['e2e_s']['p50'] for p in runs]))} | "
            f"{ms(med([p['e2e_s']['p99'] for p in runs]))} | "
            f"{ms(med([p['client_cpu_per_request_s'] for p in runs]))} |"
        )
    serve_per = med([p["per_request_s"] for p in points[COMPARED]])
    ratios = [p["per_request_s"] / c["per_request_s"] for p, c in zip(points[COMPARED], closed, strict=True)]
    ratio = serve_per / loop_per
    e2e_ratio = med([p["e2e_s"]["mean"] for p in points[COMPARED]]) / med([c["e2e_mean_s"] for c in closed])
    verdict = "met" if ratio <= TARGET else "NOT met"
    figures = [
        Figure("engine in-process, every request at once (`kvscope run`)", f"{1 / base:.1f} req/s"),
        Figure(
            f"engine in-process, closed loop of {COMPARED}",
            f"{1 / loop_per:.1f} req/s, e2e p50 {ms(med([c['e2e_p50_s'] for c in closed]))} ms",
        ),
        *(
            Figure(
                f"serve, concurrency {c}",
                f"{med([p['throughput']['requests_per_s'] for p in points[c]]):.1f} req/s; TTFT p50 "
                f"{ms(med([p['ttft_s']['p50'] for p in points[c]]))} ms, "
                f"p99 {ms(med([p['ttft_s']['p99'] for p in points[c]]))} ms; "
                f"e2e p50 {ms(med([p['e2e_s']['p50'] for p in points[c]]))} ms",
            )
            for c in CONCURRENCIES
        ),
        Figure(
            f"serve / closed loop in-process, time per request at concurrency {COMPARED}",
            f"{ratio:.3f} (per round {min(ratios):.3f} to {max(ratios):.3f})",
            f"≤ {TARGET:.2f}",
            "met" if ratio <= TARGET else "not met",
        ),
    ]
    lines += [
        "",
        f"What the front + ZMQ + client path adds at concurrency {COMPARED} (serve / the closed loop in-process): "
        f"time per request **{ratio:.3f}** (per round: {', '.join(f'{x:.3f}' for x in ratios)}), mean e2e "
        f"{e2e_ratio:.3f}; target <= {TARGET:.2f}: {verdict}. Against the every-request-at-once batch: "
        f"{serve_per / base:.3f} (that batch admits many prompts per prefill step, which a closed loop of "
        f"{COMPARED} cannot).",
    ]
    report(args, lines, figures, f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after")


def report(args: argparse.Namespace, lines: list[str], figures: list[Figure], load: str) -> None:
    """Print the body; with --write, set `figures` in the bench_serve section of RESULTS.md."""
    print("\n".join(lines))
    if args.write:
        write_figures("bench_serve", ABOUT, figures, this_run(args.device, load))


def recording_cost(args: argparse.Namespace, trace: list[TraceRequest]) -> None:
    """Serve at level off and at level full side by side; rounds alternate which goes first."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_serve-") as tmp:
        servers = {
            level: start_server(args.device, level, Path(tmp) / "capture.db" if level == "full" else None)
            for level in ("off", "full")
        }
        points: dict[str, list[dict[str, Any]]] = {"off": [], "full": []}
        try:
            for _proc, url in servers.values():
                serve_point(url, trace, COMPARED)  # warm-up, untimed
            for r in range(args.rounds):
                order = ("off", "full") if r % 2 == 0 else ("full", "off")
                for level in order:
                    proc, url = servers[level]
                    points[level].append(serve_point(url, trace, COMPARED, proc.pid))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            for proc, _url in servers.values():
                stop_server(proc)
        events = captured_events(Path(tmp) / "capture.db")
    load_after = os.getloadavg()[0]
    per = {level: [p["per_request_s"] for p in runs] for level, runs in points.items()}
    cpu = {level: [p["server_cpu_per_request_s"] for p in runs] for level, runs in points.items()}
    wall_ratios = [f / o for f, o in zip(per["full"], per["off"], strict=True)]
    cpu_ratios = [f / o for f, o in zip(cpu["full"], cpu["off"], strict=True)]
    lines = [
        f"{args.num_requests} `{args.workload}` requests (seed 0) per point on the tiny model, device {args.device}, "
        f"concurrency {COMPARED}; two servers started side by side, `--level off` and `--level full` (capture in a "
        f"temporary directory: {events:,} events recorded over all its points), {args.rounds} rounds alternating "
        "which level goes first; medians over rounds. Server CPU = user + system time of the server's process "
        "tree (front and scheduler) during a point.",
        "",
        "| level | req/s | time per request (ms) | e2e p50 (ms) | server CPU per request (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for level, runs in points.items():
        lines.append(
            f"| {level} | {statistics.median(p['throughput']['requests_per_s'] for p in runs):.1f} | "
            f"{statistics.median(per[level]) * 1000:.2f} | "
            f"{ms(statistics.median(p['e2e_s']['p50'] for p in runs))} | "
            f"{statistics.median(cpu[level]) * 1000:.2f} |"
        )
    wall = statistics.median(per["full"]) / statistics.median(per["off"]) - 1
    cpu_cost = statistics.median(cpu["full"]) / statistics.median(cpu["off"]) - 1
    writer = statistics.median(p["writer_cpu_per_request_s"] for p in points["full"])
    events_per_request = events / ((args.rounds + 1) * len(trace))
    lines += [
        "",
        f"Recording `full` vs `off` at concurrency {COMPARED}: time per request {wall:+.1%} (per round: "
        f"{', '.join(f'{x - 1:+.1%}' for x in wall_ratios)}), server CPU per request {cpu_cost:+.1%} (per round: "
        f"{', '.join(f'{x - 1:+.1%}' for x in cpu_ratios)}); target at most +3%: "
        f"{'met' if wall <= 0.03 and cpu_cost <= 0.03 else 'NOT met'}.",
        "",
        f"Within the full server's own points (steadier than the ratio of two servers): its recorder's writer "
        f"process used {writer * 1000:.2f} ms of CPU per request ({writer / statistics.median(cpu['full']):.1%} of "
        f"the server's CPU per request; {events_per_request:.0f} events per request). The rest of recording, "
        "record() and the hand-offs on the scheduler's thread, is measured per event by bench_recorder.",
    ]
    figures = [
        Figure(
            f"recording full vs off, time per request at concurrency {COMPARED}",
            f"{wall:+.1%} (per round {min(wall_ratios) - 1:+.1%} to {max(wall_ratios) - 1:+.1%})",
            "≤ +3%",
            "met" if wall <= 0.03 else "not met",
        ),
        Figure(
            f"recording full vs off, server CPU per request at concurrency {COMPARED}",
            f"{cpu_cost:+.1%} (per round {min(cpu_ratios) - 1:+.1%} to {max(cpu_ratios) - 1:+.1%})",
            "≤ +3%",
            "met" if cpu_cost <= 0.03 else "not met",
        ),
        Figure(
            "full server's recorder writer process, CPU per request",
            f"{writer * 1000:.2f} ms ({writer / statistics.median(cpu['full']):.1%} of the server's CPU per request)",
        ),
    ]
    report(args, lines, figures, f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after")


def captured_events(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT coalesce(sum(num_events), 0) FROM event_chunks").fetchone()[0])
    finally:
        conn.close()


if __name__ == "__main__":
    main()
