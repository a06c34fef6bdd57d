"""What tenant isolation costs in hit rate: the scoped radix cache vs global sharing on the
multi-tenant workload, at one capacity, with the loss split into the three terms of the
isolation note (§1.8), and the isolated one-pass curve beside the global one.

    .venv/bin/python benchmarks/bench_isolation.py [--quick] [--num-requests 2000] [--rate 1.0]
        [--capacity TOKENS] [--workers 2] [--no-write]

The cache is driven directly (kvscope.planning.replay: no model), one request at a time, its
clock the trace's arrival time, at one capacity (tree convention: the tree holds the capacity
between requests; page-granular LRU eviction, where the one-pass curves are exact). Policies:
global sharing (radix), k = inf (dedup off and on), k = inf + the tenants' system prompts pinned, and
k in {2, 3, 5} x epoch in {10, 60, 600 s}, each with dedup off and on. With --write (the
default) it sets its rows in the `## bench_isolation` table of benchmarks/RESULTS.md.

NOTE: the loss H_global - H_policy, in prompt tokens (shown as percentage points of all prompt
tokens), per request i: B_i = hits under global sharing, X_i = those of them in nodes another
principal created, P_i = hits under the policy with dedup on (same k and epoch), P'_i = with
dedup off.
    unserved_i   = min(X_i, max(B_i - P_i, 0))   baseline cross-principal hits the policy misses
    never        = sum of unserved_i over requests whose shared prefix (the prompt's first
                   P_i + unserved_i tokens) no request ever hit across principals in the
                   policy's replay: the policy never re-enabled that sharing
    waiting      = the other unserved_i: the prefix was shared across principals at some time
                   (later, once the k-th creator came and an epoch ended; or earlier and evicted)
    duplicates   = sum(P_i) - sum(P'_i): hits lost to the capacity that private copies take
                   (dedup off only; 0 with dedup on)
    residual     = (sum(B_i) - sum(P'_i)) - (never + waiting + duplicates): what the split
                   does not attribute (a policy's different eviction order, own hits lost)
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
from _results import Figure, command_line, machine, this_run, write_figures

from kvscope.planning import (
    HitRateCurve,
    ReplayConfig,
    ReplayRequest,
    ReplayResult,
    ScopedOptions,
    one_pass_curve,
    replay_many,
    replay_requests,
)
from kvscope.workloads import generate

COMMON_PROMPT_LEN = 32
TENANT_PROMPT_LEN = 64
KS = (2, 3, 5)
EPOCHS_S = (10.0, 60.0, 600.0)
SIZING_SHARE = 0.95  # the default capacity: where global sharing gets this share of its best hit rate
HASH_BASE, HASH_MOD = 1_000_003, (1 << 61) - 1


def workload(num_requests: int, rate_per_s: float, seed: int) -> list[ReplayRequest]:
    trace = generate(
        "multi-tenant",
        num_requests=num_requests,
        seed=seed,
        rate_per_s=rate_per_s,
        num_tenants=4,
        users_per_tenant=4,
        common_prompt_len=COMMON_PROMPT_LEN,
        tenant_prompt_len=TENANT_PROMPT_LEN,
    )
    return replay_requests(trace)


def tenant_prompts(requests: Sequence[ReplayRequest]) -> tuple[tuple[int, ...], ...]:
    """Each tenant's system prompt (common + tenant prompt): every prompt of a tenant's users
    starts with it (generators_session.multi_tenant), so the first request of each tenant shows it."""
    prompts: dict[str, tuple[int, ...]] = {}
    for r in requests:
        tenant = (r.user or "").split("-")[0]
        prompts.setdefault(tenant, tuple(int(t) for t in r.prompt_ids[: COMMON_PROMPT_LEN + TENANT_PROMPT_LEN]))
    return tuple(prompts.values())


def policies(pinned: tuple[tuple[int, ...], ...]) -> list[tuple[str, ScopedOptions | None]]:
    rows: list[tuple[str, ScopedOptions | None]] = [
        ("global sharing (radix)", None),
        ("k = inf, dedup off", ScopedOptions(promote_k=None)),
        ("k = inf, dedup on", ScopedOptions(promote_k=None, dedup=True)),
        ("k = inf + pinned system prompts", ScopedOptions(promote_k=None, pinned=pinned)),
    ]
    for k in KS:
        for epoch_s in EPOCHS_S:
            for dedup in (False, True):
                rows.append(
                    (
                        f"k = {k}, epoch {epoch_s:g} s, dedup {'on' if dedup else 'off'}",
                        ScopedOptions(promote_k=k, epoch_s=epoch_s, dedup=dedup),
                    )
                )
    return rows


def sized_capacity(curve: HitRateCurve) -> int:
    """The smallest capacity at which the curve reaches SIZING_SHARE of its unbounded hits."""
    capacities, hits = curve.breakpoints()
    return int(capacities[np.argmax(hits >= SIZING_SHARE * curve.max_hit_tokens)])


def prefix_hashes(ids: np.ndarray, length: int) -> list[int]:
    """Polynomial hashes of ids[:1], ids[:2], ..., ids[:length]."""
    out, h = [], 0
    for token in ids[:length].tolist():
        h = (h * HASH_BASE + token + 1) % HASH_MOD
        out.append(h)
    return out


def shared_prefixes(requests: Sequence[ReplayRequest], result: ReplayResult) -> set[tuple[int, int]]:
    """(length, hash) of every prompt prefix a request of `result` hit while some of its hit was
    another principal's (a prefix the policy shared across principals at some time)."""
    shared: set[tuple[int, int]] = set()
    assert result.request_cross_hit_tokens is not None
    for r, hit, cross in zip(requests, result.request_hit_tokens, result.request_cross_hit_tokens, strict=True):
        if cross > 0:
            shared.update(enumerate(prefix_hashes(r.prompt_ids, int(hit)), 1))
    return shared


def loss_split(
    requests: Sequence[ReplayRequest], glob: ReplayResult, on: ReplayResult, off: ReplayResult | None
) -> dict[str, int]:
    """The terms of the module note, in tokens; `off` None for a dedup-on row."""
    assert glob.request_cross_hit_tokens is not None
    shared = shared_prefixes(requests, on)
    never = waiting = 0
    hits_g, cross_g, hits_on = glob.request_hit_tokens, glob.request_cross_hit_tokens, on.request_hit_tokens
    for r, b, x, p in zip(requests, hits_g, cross_g, hits_on, strict=True):
        unserved = int(min(max(x, 0), max(b - max(p, 0), 0)))
        if unserved:
            end = int(max(p, 0)) + unserved
            if (end, prefix_hashes(r.prompt_ids, end)[-1]) in shared:
                waiting += unserved
            else:
                never += unserved
    policy = off if off is not None else on
    duplicates = on.num_hit_tokens - off.num_hit_tokens if off is not None else 0
    residual = (glob.num_hit_tokens - policy.num_hit_tokens) - (never + waiting + duplicates)
    return {"never": never, "waiting": waiting, "duplicates": duplicates, "residual": residual}


def pp(num_tokens: int, num_prompt_tokens: int) -> str:
    return f"{100 * num_tokens / max(num_prompt_tokens, 1):.2f}"


def policy_table(requests: Sequence[ReplayRequest], labels: list[str], results: list[ReplayResult]) -> list[str]:
    num_prompt = results[0].num_prompt_tokens
    glob = results[0]
    by_label = dict(zip(labels, results, strict=True))
    lines = [
        "| policy | token hit rate | prefill tokens | cross-principal hit tokens | promotions "
        "| loss (pp) | never re-enabled | waiting for k-th creator | duplicate copies | residual |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for label, result in zip(labels, results, strict=True):
        prefill = num_prompt - result.num_hit_tokens
        stats = result.cache_stats or {}
        promotions = stats.get("promotions", "-")
        cells = [label, f"{result.hit_rate:.2%}", f"{prefill:,}", f"{result.num_cross_hit_tokens:,}", f"{promotions}"]
        if result is glob:
            lines.append("| " + " | ".join([*cells, "0", "-", "-", "-", "-"]) + " |")
            continue
        on = by_label.get(label.replace("dedup off", "dedup on"), result)
        split = loss_split(requests, glob, on, result if "dedup off" in label else None)
        loss = glob.num_hit_tokens - result.num_hit_tokens
        lines.append(
            "| "
            + " | ".join(
                [
                    *cells,
                    pp(loss, num_prompt),
                    *(pp(split[k], num_prompt) for k in ("never", "waiting", "duplicates", "residual")),
                ]
            )
            + " |"
        )
    return lines


def curve_table(requests: Sequence[ReplayRequest], capacity: int, inf_result: ReplayResult) -> list[str]:
    glob, isolated = one_pass_curve(requests), one_pass_curve(requests, isolated=True)
    grid = sorted({*(int(c) for c in glob.log_grid(8)), capacity})
    lines = [
        "| capacity (tokens) | global one-pass | isolated one-pass (k = inf) | isolation cost (pp) |",
        "|--:|--:|--:|--:|",
    ]
    for c in grid:
        mark = " (the replays' capacity)" if c == capacity else ""
        lines.append(
            f"| {c:,}{mark} | {glob.hit_rate(c):.2%} | {isolated.hit_rate(c):.2%} "
            f"| {100 * (glob.hit_rate(c) - isolated.hit_rate(c)):.2f} |"
        )
    same = int(np.sum(isolated.request_hit_tokens(capacity) == inf_result.request_hit_tokens))
    lines += [
        "",
        f"Working sets: global {glob.working_set_tokens:,} tokens, isolated {isolated.working_set_tokens:,}. "
        f"At {capacity:,} tokens the k = inf replay hits {inf_result.hit_rate:.2%} and the isolated curve "
        f"{isolated.hit_rate(capacity):.2%}; {same:,} of {len(requests):,} requests agree token for token.",
    ]
    return lines


ABOUT = (
    "What tenant isolation costs in token hit rate on a multi-tenant trace at one capacity: global "
    "sharing against k-th-creator promotion (k x epoch x dedup) and pinned system prompts."
)


def figures(
    requests: Sequence[ReplayRequest], labels: list[str], results: list[ReplayResult], capacity: int
) -> list[Figure]:
    """RESULTS.md rows: each policy's hit rate and loss, then the isolated curve at the capacity."""
    glob, num_prompt = results[0], results[0].num_prompt_tokens
    rows = []
    for label, result in zip(labels, results, strict=True):
        loss = pp(glob.num_hit_tokens - result.num_hit_tokens, num_prompt)
        promotions = (result.cache_stats or {}).get("promotions", "-")
        rows.append(
            Figure(f"token hit rate, {label}", f"{result.hit_rate:.2%} (loss {loss} pp; promotions {promotions})")
        )
    glob_curve, isolated = one_pass_curve(requests), one_pass_curve(requests, isolated=True)
    g, i = glob_curve.hit_rate(capacity), isolated.hit_rate(capacity)
    rows.append(
        Figure(
            f"isolated one-pass curve vs global at the replays' capacity ({capacity:,} tokens)",
            f"{i:.2%} vs {g:.2%} ({100 * (g - i):.2f} pp)",
        )
    )
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 requests")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second (trace time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--capacity",
        type=int,
        help="the replays' capacity in tokens (default: the smallest where the global one-pass "
        f"curve reaches {SIZING_SHARE:.0%} of its unbounded hit rate)",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="set its rows in the bench_isolation table of benchmarks/RESULTS.md",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    num_requests = 300 if args.quick else args.num_requests
    load, start = os.getloadavg()[0], time.perf_counter()
    requests = workload(num_requests, args.rate, args.seed)
    num_prompt = sum(r.prompt_len for r in requests)
    capacity = args.capacity or sized_capacity(one_pass_curve(requests))
    base = ReplayConfig(capacity, 1, "page", "tree")
    named = policies(tenant_prompts(requests))
    results = replay_many(requests, [replace(base, scoped=options) for _, options in named], args.workers)
    labels = [label for label, _ in named]
    span_s = (requests[-1].arrival_s or 0.0) - (requests[0].arrival_s or 0.0)
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    sizing = "given" if args.capacity else f"where the global one-pass curve reaches {SIZING_SHARE:.0%} of its best"
    body = "\n".join(
        [
            f"- date: {now}",
            f"- command: `{command_line()}`",
            f"- machine: {machine('cpu')}",
            f"- load average (1 min) at the start: {load:.2f}; whole run {time.perf_counter() - start:.0f} s",
            f"- workload: multi-tenant, {len(requests):,} requests, seed {args.seed}, "
            f"4 tenants x 4 users, common prompt "
            f"{COMMON_PROMPT_LEN} + tenant prompt {TENANT_PROMPT_LEN} tokens, Poisson arrivals at {args.rate:g}/s "
            f"({span_s:,.0f} s of trace time), {num_prompt:,} prompt tokens",
            f"- replays: {capacity:,} tokens ({sizing}), tree convention, "
            "page-granular LRU, page size 1; principal = the request's user; clock = trace time (arrival_s); the cache "
            "driven directly (`kvscope.planning.replay`), no model",
            "",
            "### Hit rate and the loss split, per policy",
            "",
            *policy_table(requests, labels, results),
            "",
            "Loss columns are percentage points of all prompt tokens: loss = H_global - H_policy, split as the "
            "module note of `benchmarks/bench_isolation.py` defines: never re-enabled (baseline cross-principal "
            "hits on prefixes the policy never shared across principals), waiting (on prefixes it shared at some "
            "time), duplicate copies (dedup on minus dedup off at the same k and epoch), and the residual the split "
            "does not attribute; the pinned row, which has no dedup twin, splits its own replay. Cross-principal hit "
            "tokens: hits in public or pinned nodes another principal created (a private node a principal joined "
            "through dedup is its own computation and does not count).",
            "",
            "### The isolated one-pass curve beside the global one",
            "",
            *curve_table(requests, capacity, results[labels.index("k = inf, dedup off")]),
        ]
    )
    print(body)
    if args.write:
        run = this_run("cpu", f"load average {load:.2f} (1 min) at the start")
        write_figures("bench_isolation", ABOUT, figures(requests, labels, results, capacity), run)


if __name__ == "__main__":
    main()
