"""`kvscope plan` and `kvscope replay`: capacity on a GPU, and hit rate vs cache capacity.

Handlers return the exit code and raise ValueError (one line) on bad input; cli.main prints
`kvscope <verb>: error: ...` and exits 2. Neither loads torch: replays run in worker processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, TextIO

from kvscope.app.progress import Progress, bar
from kvscope.app.units import gib_text, scoped_cache_options
from kvscope.engine import cache_kind
from kvscope.planning import (
    CONVENTION_MEANINGS,
    EXACTNESS,
    HitRateCurve,
    PlanInputs,
    ReplayConfig,
    ReplayRequest,
    ReplayResult,
    ReplaySource,
    ScopedOptions,
    ceil_pages,
    format_plan,
    format_replay,
    gpu_line,
    load_source,
    one_pass_curve,
    plan_memory,
    probe_gpus,
    replay_many,
    resolve_model,
)

PROGRESS_DELAY_S = 1.0  # replays shorter than this show no progress
CURVE_CONVENTION = "tree"  # the one-pass curve's capacity convention (exact there)

# -- plan ----------------------------------------------------------------------------------------


def plan_verb(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """--gpu-mem, --weights-gib and --vllm-activation-gib arrive in bytes (commands/plan.py parses the units)."""
    out = sys.stdout if out is None else out
    model = resolve_model(args.model, args.weights_gib)
    free, total, gpu_lines, gpus = _gpu_memory(args.gpu_mem, args.tp)
    inputs = PlanInputs(
        model,
        free,
        total,
        tp_size=args.tp,
        kv_dtype=args.kv_dtype,
        page_size=args.page_size,
        mem_fraction_static=args.mem_fraction_static,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        context_len=args.context_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        vllm_activation_bytes=args.vllm_activation_gib,
    )
    plan = plan_memory(inputs)
    if args.json:
        out.write(json.dumps({**plan.to_dict(), "gpus": gpus}, indent=2) + "\n")
    else:
        out.write(format_plan(plan, gpu_lines) + "\n")
    return 0


def _gpu_memory(gpu_mem_bytes: int | None, tp_size: int) -> tuple[int, int, list[str], list[dict[str, Any]]]:
    """(free, total) bytes per GPU, description lines, and the GPUs as dicts for --json."""
    if gpu_mem_bytes is not None:
        if gpu_mem_bytes <= 0:
            raise ValueError(f"--gpu-mem must be > 0, got {gpu_mem_bytes} bytes")
        return gpu_mem_bytes, gpu_mem_bytes, [f"GPU memory {gib_text(gpu_mem_bytes)} (given)"], []
    gpus = probe_gpus()
    if not gpus:
        raise ValueError("no GPU visible to NVML; give the memory per GPU with --gpu-mem SIZE (80GiB)")
    ranks = gpus[:tp_size]
    lines = [gpu_line(g) for g in gpus]
    lines.append(
        f"planning with the smallest free / total of GPUs {', '.join(str(g.gpu_index) for g in ranks)}"
        + (f" ({len(gpus)} visible for TP {tp_size})" if len(gpus) < tp_size else "")
    )
    free, total = min(g.free_bytes for g in ranks), min(g.total_bytes for g in ranks)
    return free, total, lines, [g._asdict() for g in gpus]


# -- replay --------------------------------------------------------------------------------------


def replay_verb(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if getattr(args, "dp_size", None) is not None or getattr(args, "dispatch", None) is not None:
        return fleet_replay_verb(args, out)
    scoped = _check_replay_args(args)
    source = load_source(args.source, args.run)
    page_size = args.page_size or source.page_size or 1
    _check_page_size(page_size)
    requests = source.requests
    curve = one_pass_curve(requests, page_size)
    isolated = one_pass_curve(requests, page_size, isolated=True) if scoped is not None else None
    longest = max(ceil_pages(r.seq_len, page_size) for r in requests)
    capacities = _capacities(args, curve, longest, page_size)
    rows = [_curve_row(curve, c, args.policy, isolated) for c in capacities]
    if not args.curve_only:
        results = _replays(requests, capacities, page_size, args, err, scoped)
        for row, result in zip(rows, results[: len(capacities)], strict=True):
            row.update(_result_fields(result))
            if scoped is not None:
                row["cross_hit_tokens"] = result.num_cross_hit_tokens
        for row, result in zip(rows, results[len(capacities) :], strict=False):  # NOTE: none without scoped
            row.update(_scoped_fields(row, result))
    header = _replay_header(args, source.label, curve, longest, page_size, _page_size_origin(args, source.page_size))
    if scoped is not None:
        header["scoped"] = (
            f"scoped-radix, {scoped.describe()}; principal = each request's user; clock = "
            f"{_clock_text(requests)}; beside global sharing (radix) at the same settings"
        )
    lru = args.policy == "lru"
    if args.json:
        report = _replay_json(args, source, header, rows, curve, page_size)
        report["cache"] = args.cache
        report["scoped"] = None if scoped is None else dataclasses.asdict(scoped)
        report["isolated_curve"] = None if isolated is None or not lru else _curve_json(isolated)
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        out.write(format_replay(header, rows, curve if lru else None, isolated if lru else None) + "\n")
    return 0


def _clock_text(requests: list[ReplayRequest]) -> str:
    if all(r.arrival_s is not None for r in requests):
        return "trace time (arrival_s)"
    return "the request's index x 1 s (the trace has no arrival_s on every request)"


def _scoped_fields(row: dict[str, Any], result: ReplayResult) -> dict[str, Any]:
    """The scoped replay's columns beside a row that holds the global replay's."""
    return {
        "scoped_hit_rate": result.hit_rate,
        "scoped_hit_tokens": result.num_hit_tokens,
        "scoped_cost_hit_rate": row["hit_rate"] - result.hit_rate,
        "scoped_evicted_tokens": result.num_evicted_tokens,
        "scoped_peak_usage_tokens": result.peak_usage_tokens,
        "scoped_num_skipped": result.num_skipped,
        "scoped_wall_s": result.wall_s,
        "scoped_stats": result.cache_stats,
    }


def _check_replay_args(args: argparse.Namespace) -> ScopedOptions | None:
    """The scoped options when --cache scoped-radix (ValueError for scoped flags without it)."""
    cache = getattr(args, "cache", "radix")
    options = scoped_cache_options(args, cache)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.page_size is not None:
        _check_page_size(args.page_size)
    if args.curve_only and args.policy != "lru":
        raise ValueError(f"the one-pass curve models lru eviction only, not {args.policy!r}")
    return ScopedOptions(**options) if cache_kind(cache).scoped else None


def _check_page_size(page_size: int) -> None:
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"--page-size must be a power of two >= 1, got {page_size}")


def _page_size_origin(args: argparse.Namespace, captured: int | None) -> str:
    if args.page_size is not None:
        return "given"
    return "the capture's" if captured is not None else "default"


def _capacities(args: argparse.Namespace, curve: HitRateCurve, longest: int, page_size: int) -> list[int]:
    """Page-floored capacities. Under the slots convention none below the longest request (whole
    pages): a pool that small cannot serve it; the default grid starts there, a given one is an error."""
    given = args.capacities is not None
    capacities = sorted({int(c) // page_size * page_size for c in (args.capacities if given else curve.log_grid())})
    if args.convention != "slots" or args.curve_only:
        return capacities
    small = [c for c in capacities if c < longest]
    if small and given:
        raise ValueError(
            f"capacity {small[0]:,} is below the longest request ({longest:,} tokens in whole pages), "
            "which a pool of that many slots cannot serve; give capacities >= that, or --convention tree"
        )
    return [c for c in capacities if c >= longest] or [longest]


def _curve_row(curve: HitRateCurve, capacity: int, policy: str, isolated: HitRateCurve | None) -> dict[str, Any]:
    row: dict[str, Any] = {"capacity": capacity, "curve_hit_rate": None, "curve_hit_tokens": None}
    if policy == "lru":
        row["curve_hit_tokens"] = curve.hit_tokens(capacity)
        row["curve_hit_rate"] = curve.hit_rate(capacity)
    if isolated is not None:
        lru = policy == "lru"
        row["isolated_curve_hit_tokens"] = isolated.hit_tokens(capacity) if lru else None
        row["isolated_curve_hit_rate"] = isolated.hit_rate(capacity) if lru else None
    return row


def _replays(
    requests: list[ReplayRequest],
    capacities: list[int],
    page_size: int,
    args: argparse.Namespace,
    err: TextIO,
    scoped: ScopedOptions | None = None,
) -> list[ReplayResult]:
    """One replay per capacity (global sharing), then one scoped replay per capacity when `scoped`."""
    configs = [ReplayConfig(c, page_size, args.eviction, args.convention, args.policy) for c in capacities]
    if scoped is not None:
        configs += [dataclasses.replace(config, scoped=scoped) for config in configs]
    progress = Progress(err, delay_s=PROGRESS_DELAY_S)

    def on_done(num_done: int, num_total: int) -> None:
        if progress.due():
            progress.draw(f"{bar(num_done, num_total)} {num_done}/{num_total} capacities, {progress.elapsed_s:.0f} s ")

    try:  # NOTE: always in worker processes, so this one never loads torch
        return replay_many(requests, configs, args.workers, on_done=on_done, always_spawn=True)
    finally:
        progress.close()


def _replay_header(
    args: argparse.Namespace, label: str, curve: HitRateCurve, longest: int, page_size: int, page_size_origin: str
) -> dict[str, str]:
    """The lines above the table: the source, the replay settings and each column's convention."""
    header = {
        "source": f"{label}: {curve.num_requests:,} requests, {curve.num_prompt_tokens:,} prompt tokens, "
        f"longest {longest:,} tokens (whole pages)",
        "replay": "none (--curve-only)"
        if args.curve_only
        else f"page size {page_size} ({page_size_origin}), {args.policy} eviction by {args.eviction}",
    }
    conventions = (
        [] if args.curve_only else [f"replays: {args.convention} convention, {CONVENTION_MEANINGS[args.convention]}"]
    )
    if args.policy == "lru":
        conventions.append(f"one-pass: {CURVE_CONVENTION} convention, {CONVENTION_MEANINGS[CURVE_CONVENTION]}")
    header["conventions"] = "; ".join(conventions)
    if not args.curve_only:
        header.update(_replay_notes(longest, args))
    return header


def _replay_notes(longest: int, args: argparse.Namespace) -> dict[str, str]:
    """How to read the replays beside the curve (lru only)."""
    if args.policy != "lru":
        return {"note": "the one-pass curve models lru only"}
    notes = {}
    if args.convention == "slots":
        notes["bounds"] = (
            f"a replay's hits lie between the curve at C - {longest:,} and at C (C: its capacity; "
            f"{longest:,}: the longest request, whole pages)"
        )
    if args.eviction == "leaf":
        notes["note"] = "whole-leaf eviction may evict more than needed; the curve does not model it"
    return notes


def _result_fields(result: ReplayResult) -> dict[str, Any]:
    return {
        "hit_rate": result.hit_rate,
        "hit_tokens": result.num_hit_tokens,
        "evicted_tokens": result.num_evicted_tokens,
        "peak_usage_tokens": result.peak_usage_tokens,
        "num_skipped": result.num_skipped,
        "wall_s": result.wall_s,
    }


def _replay_json(
    args: argparse.Namespace,
    source: ReplaySource,
    header: dict[str, str],
    rows: list[dict[str, Any]],
    curve: HitRateCurve,
    page_size: int,
) -> dict[str, Any]:
    """The shape is documented in docs/cli.md (replay --json)."""
    return {
        "source": args.source,
        "run": source.run_id,
        "num_requests": curve.num_requests,
        "num_prompt_tokens": curve.num_prompt_tokens,
        "longest_request_tokens": max(ceil_pages(r.seq_len, page_size) for r in source.requests),
        "page_size": page_size,
        "eviction": args.eviction,
        "convention": args.convention,
        "policy": args.policy,
        "replayed": not args.curve_only,
        "conventions": {
            "replays": None
            if args.curve_only
            else {"name": args.convention, "meaning": CONVENTION_MEANINGS[args.convention]},
            "curve": {
                "name": CURVE_CONVENTION,
                "meaning": CONVENTION_MEANINGS[CURVE_CONVENTION],
                "exactness": EXACTNESS,
            }
            if args.policy == "lru"
            else None,
        },
        "notes": header,
        "curve": _curve_json(curve),
        "rows": rows,
    }


def _curve_json(curve: HitRateCurve) -> dict[str, Any]:
    return {
        "exactness": EXACTNESS,
        "working_set_tokens": curve.working_set_tokens,
        "max_hit_tokens": curve.max_hit_tokens,
        "max_hit_rate": curve.max_hit_rate,
        "saturation_tokens": curve.saturation_tokens,
    }


def fleet_replay_verb(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """`kvscope replay --dp-size N [--dispatch METHOD|all]`: the trace routed among N radix caches
    (planning/fleet_replay.py), one row per dispatch method."""
    out = sys.stdout if out is None else out
    from kvscope.planning.fleet_replay import dispatch_methods, fleet_json, format_fleet, replay_fleet

    methods = dispatch_methods(_check_fleet_args(args))
    source = load_source(args.source, args.run)
    if args.dp_size > len(source.requests):  # NOTE: each replica is a cache in memory; the rest would stay empty
        raise ValueError(
            f"--dp-size {args.dp_size:,} is more replicas than {source.label} has requests "
            f"({len(source.requests):,}): give at most {len(source.requests):,}"
        )
    page_size = args.page_size or source.page_size or 1
    _check_page_size(page_size)
    capacity = args.capacities[0] // page_size * page_size
    config = ReplayConfig(capacity, page_size, args.eviction, args.convention, args.policy)
    results = [replay_fleet(source.requests, config, args.dp_size, method) for method in methods]
    header = (
        f"{source.label}: {len(source.requests):,} requests routed among {args.dp_size} radix caches of "
        f"{capacity:,} tokens each (page size {page_size}, {args.policy} eviction by {args.eviction}, "
        f"{args.convention} convention)"
    )
    if args.json:
        report = {"source": source.label, "dp_size": args.dp_size, "capacity_per_replica": capacity}
        report["page_size"] = page_size
        report["methods"] = [fleet_json(r) for r in results]
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        out.write(format_fleet(header, results) + "\n")
    return 0


def _check_fleet_args(args: argparse.Namespace) -> str:
    """The dispatch method (or "all"); ValueError with one line for a combination that makes no sense."""
    if args.dp_size is None:
        raise ValueError("--dispatch routes among replicas: give --dp-size N too")
    if args.dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {args.dp_size}")
    if args.curve_only:
        raise ValueError("--dp-size replays the fleet; the one-pass curve (--curve-only) has no replicas")
    if getattr(args, "cache", "radix") != "radix":
        raise ValueError("--dp-size replays the radix cache; --cache scoped-radix is not supported with it")
    if not args.capacities or len(args.capacities) != 1:
        raise ValueError("--dp-size needs one capacity per replica: --capacities TOKENS (a single value)")
    return args.dispatch or "all"
