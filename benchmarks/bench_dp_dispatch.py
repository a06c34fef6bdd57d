"""`kvscope serve --dp-size 2` under `kvscope load` on the multi-tenant workload, once per dispatch
method: requests answered, each rank's requests and hit rate, and the routing loss.

    .venv/bin/python benchmarks/bench_dp_dispatch.py [--num-requests N] [--concurrency C]
                                                     [--methods M ...] [--write | --no-write]

Prints a Markdown table; with --write (the default) also sets its rows in the
`## bench_dp_dispatch` table of benchmarks/RESULTS.md.

NOTE: what runs, per method: `python -m kvscope serve --port 0 --device cpu --dp-size 2
--load-balance-method M --level summary --capture TMP/M.db` (the tiny model, serve's default
engine otherwise), then `python -m kvscope load --workload multi-tenant --num-requests N
--concurrency C --max-tokens 4 --json --quiet` against it, then SIGTERM. The figures come from
the capture's rows (one run per rank, told apart by the run config's fleet.rank):
    hit rate      Σ cached_tokens / Σ prompt_len of the rank's requests
    routing loss  Σ max(0, elsewhere_cached_tokens − routed_cached_tokens) / Σ prompt_len over
                  every routed request (the tokens cached on another rank at arrival but not on
                  the chosen one; issue 30's definition, computed here until kvscope.fleet has it)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sqlite3
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from _results import Figure, this_run, write_figures

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # NOTE: tests.server.serving starts the server as the server tests do

from tests.server.serving import start_server  # noqa: E402

SERVE_OPTIONS = ("--dp-size", "2", "--level", "summary")  # NOTE: beside serving.py's --port 0 --device cpu
METHODS = ("round_robin", "total_requests", "total_tokens", "prefix_affinity")


@dataclass
class Outcome:
    method: str
    completed: int
    failed: int
    requests_per_s: float
    rank_requests: list[int]
    rank_hit_rates: list[float]
    routing_loss: float


def load_args(url: str, num_requests: int, concurrency: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvscope",
        "load",
        "--url",
        url,
        "--workload",
        "multi-tenant",
        "--num-requests",
        str(num_requests),
        "--concurrency",
        str(concurrency),
        "--max-tokens",
        "4",
        "--json",
        "--quiet",
    ]


def run_method(method: str, num_requests: int, concurrency: int, tmp: Path) -> Outcome:
    capture = tmp / f"{method}.db"
    server = start_server(capture, *SERVE_OPTIONS, "--load-balance-method", method)
    try:
        load = subprocess.run(
            load_args(server.url, num_requests, concurrency), cwd=REPO, capture_output=True, text=True
        )
        if load.returncode not in (0, 1):
            raise SystemExit(f"bench_dp_dispatch: kvscope load failed: {load.stderr.strip()}")
        summary = json.loads(load.stdout)
    finally:
        server.stop()
    requests = summary["requests"]
    rank_requests, rank_hit_rates = per_rank(capture)
    return Outcome(
        method,
        requests["completed"],
        requests["failed"],
        summary["throughput"]["requests_per_s"],
        rank_requests,
        rank_hit_rates,
        routing_loss(capture),
    )


def per_rank(capture: Path) -> tuple[list[int], list[float]]:
    """Each rank's (requests, hit rate), rank order."""
    with contextlib.closing(sqlite3.connect(capture)) as db:
        rows = db.execute(
            "SELECT json_extract(runs.config, '$.fleet.rank') AS rank, COUNT(*), SUM(cached_tokens), SUM(prompt_len) "
            "FROM requests JOIN runs ON runs.id = requests.run_id GROUP BY rank ORDER BY rank"
        ).fetchall()
    return [n for _, n, _, _ in rows], [cached / prompt if prompt else 0.0 for _, _, cached, prompt in rows]


def routing_loss(capture: Path) -> float:
    """Σ max(0, elsewhere − routed) / Σ prompt tokens over the routed requests, as kvscope.fleet.figures
    reads it (the Fleet page and `kvscope fleet` show the same figure)."""
    from kvscope.fleet.figures import routing_loss as loss_per_method
    from kvscope.telemetry import Capture

    capture_reader = Capture(capture)
    try:
        rows = pd.concat([capture_reader.requests(run_id) for run_id in capture_reader.runs()["id"]])
    finally:
        capture_reader.close()
    table = loss_per_method(rows)
    lost, prompt = int(table["loss_tokens"].sum()), int(table["prompt_tokens"].sum())
    return lost / prompt if prompt else 0.0


def table(outcomes: list[Outcome], num_requests: int) -> str:
    rows = [
        "| method | answered | failed | requests/s | requests per rank | hit rate per rank | routing loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        per_rank_requests = " / ".join(str(n) for n in o.rank_requests)
        hit_rates = " / ".join(f"{rate:.1%}" for rate in o.rank_hit_rates)
        rows.append(
            f"| {o.method} | {o.completed}/{num_requests} | {o.failed} | {o.requests_per_s:.2f} | "
            f"{per_rank_requests} | {hit_rates} | {o.routing_loss:.1%} |"
        )
    return "\n".join(rows)


ABOUT = (
    "`kvscope serve --dp-size 2` under a multi-tenant load, per dispatch method: requests answered, "
    "hit rate per rank and the routing loss (cached tokens another rank held)."
)


def figures(outcomes: list[Outcome], num_requests: int) -> list[Figure]:
    return [
        Figure(
            f"dispatch {o.method}",
            f"routing loss {o.routing_loss:.1%}; hit rate per rank "
            f"{' / '.join(f'{rate:.1%}' for rate in o.rank_hit_rates)}; requests per rank "
            f"{' / '.join(str(n) for n in o.rank_requests)}; {o.completed}/{num_requests} answered, {o.failed} failed; "
            f"{o.requests_per_s:.2f} requests/s",
        )
        for o in outcomes
    ]


def notes(num_requests: int, concurrency: int) -> list[str]:
    """How the table was measured: the commands, the figures' definitions."""
    serve = ["-m kvscope serve --port 0 --device cpu --capture TMP/METHOD.db", *SERVE_OPTIONS]
    example = " ".join([*serve, "--load-balance-method METHOD"])
    loads = " ".join(load_args("URL", num_requests, concurrency)[1:])
    return [
        "",
        f"- server: `python {example}`; load: `python {loads}`",
        "- routing loss: Σ max(0, elsewhere − routed cached tokens) / Σ prompt tokens of the routed "
        "requests, from the capture's requests rows; hit rate per rank: Σ cached / Σ prompt tokens",
        "- one run per method, the two ranks and the load client sharing the machine's cores: "
        "requests/s is noisy; the routing loss and hit rates depend on the workload, not the timing, "
        "except through which requests overlap",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--write", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-dp-") as tmp:
        outcomes = [run_method(m, args.num_requests, args.concurrency, Path(tmp)) for m in args.methods]
    print(table(outcomes, args.num_requests))
    print("\n".join(notes(args.num_requests, args.concurrency)))
    if args.write:
        write_figures("bench_dp_dispatch", ABOUT, figures(outcomes, args.num_requests), this_run("cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
