"""`kvscope plan` and `kvscope replay`: capacity on a GPU, and hit rate vs cache capacity.

Handlers return the exit code and raise ValueError (one line) on bad input; cli.main prints
`kvscope <verb>: error: ...` and exits 2. Torch loads only when `replay` runs replays.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from kvscope.app.progress import Progress, bar
from kvscope.planning import (
    EXACTNESS,
    GIB,
    HitRateCurve,
    PlanInputs,
    ReplayRequest,
    format_plan,
    format_replay,
    gpu_line,
    load_requests,
    one_pass_curve,
    plan_memory,
    probe_gpus,
    resolve_model,
)

PROGRESS_DELAY_S = 1.0  # replays shorter than this show no progress

# -- plan ----------------------------------------------------------------------------------------


def plan_verb(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    weights = None if args.weights_gib is None else _gib_bytes(args.weights_gib, "--weights-gib")
    model = resolve_model(args.model, weights)
    free, total, gpu_lines, gpus = _gpu_memory(args.gpu_mem, args.tp)
    inputs = PlanInputs(
        model, free, total, tp_size=args.tp, kv_dtype=args.kv_dtype, page_size=args.page_size,
        mem_fraction_static=args.mem_fraction_static, swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        context_len=args.context_len, gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size, vllm_activation_bytes=_gib_bytes(args.vllm_activation_gib, "--vllm-activation-gib"),
    )
    plan = plan_memory(inputs)
    if args.json:
        out.write(json.dumps({**plan.to_dict(), "gpus": gpus}, indent=2) + "\n")
    else:
        out.write(format_plan(plan, gpu_lines) + "\n")
    return 0


def _gib_bytes(value: float, flag: str) -> int:
    if not value >= 0:
        raise ValueError(f"{flag} must be >= 0 GiB, got {value}")
    return int(value * GIB)


def _gpu_memory(gpu_mem_gib: float | None, tp_size: int) -> tuple[int, int, list[str], list[dict[str, Any]]]:
    """(free, total) bytes per GPU, description lines, and the GPUs as dicts for --json."""
    if gpu_mem_gib is not None:
        if not gpu_mem_gib > 0:
            raise ValueError(f"--gpu-mem must be > 0 GiB, got {gpu_mem_gib}")
        size = int(gpu_mem_gib * GIB)
        return size, size, [f"GPU memory {gpu_mem_gib:g} GiB (given)"], []
    gpus = probe_gpus()
    if not gpus:
        raise ValueError("no GPU visible to NVML; give the memory per GPU with --gpu-mem GIB")
    ranks = gpus[:tp_size]
    lines = [gpu_line(g) for g in gpus]
    lines.append(f"planning with the smallest free / total of GPUs {', '.join(str(g.gpu_index) for g in ranks)}"
                 + (f" ({len(gpus)} visible for TP {tp_size})" if len(gpus) < tp_size else ""))
    free, total = min(g.free_bytes for g in ranks), min(g.total_bytes for g in ranks)
    return free, total, lines, [g._asdict() for g in gpus]


# -- replay --------------------------------------------------------------------------------------


def replay_verb(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        raise ValueError(f"--page-size must be a power of two >= 1, got {args.page_size}")
    if args.curve_only and args.policy != "lru":
        raise ValueError(f"the one-pass curve models lru eviction only, not {args.policy!r}")
    requests = load_requests(args.source, args.run_id)
    curve = one_pass_curve(requests, args.page_size)
    capacities = sorted({int(c) // args.page_size * args.page_size for c in (args.capacities or curve.log_grid())})
    rows = [_curve_row(curve, c, args.policy) for c in capacities]
    header = {
        "source": f"{args.source}: {len(requests):,} requests, {curve.num_prompt_tokens:,} prompt tokens",
        "replay": "none (--curve-only)" if args.curve_only else
        f"page size {args.page_size}, {args.policy} eviction by {args.eviction}, {args.convention} convention",
    }
    if not args.curve_only:
        for row, result in zip(rows, _replays(requests, capacities, args, err), strict=True):
            row.update(_result_fields(result))
        header.update(_replay_notes(requests, args))
    if args.json:
        out.write(json.dumps(_replay_json(args, header, rows, curve), indent=2) + "\n")
    else:
        out.write(format_replay(header, rows, curve if args.policy == "lru" else None) + "\n")
    return 0


def _curve_row(curve: HitRateCurve, capacity: int, policy: str) -> dict[str, Any]:
    row: dict[str, Any] = {"capacity": capacity, "curve_hit_rate": None, "curve_hit_tokens": None}
    if policy == "lru":
        row["curve_hit_tokens"] = curve.hit_tokens(capacity)
        row["curve_hit_rate"] = curve.hit_rate(capacity)
    return row


def _replays(requests: Any, capacities: list[int], args: argparse.Namespace, err: TextIO) -> list[Any]:
    from kvscope.planning import ReplayConfig, replay_many  # loads the radix cache and torch

    configs = [ReplayConfig(c, args.page_size, args.eviction, args.convention, args.policy) for c in capacities]
    progress = Progress(err, delay_s=PROGRESS_DELAY_S)

    def on_done(num_done: int, num_total: int) -> None:
        if progress.due():
            progress.draw(f"{bar(num_done, num_total)} {num_done}/{num_total} capacities, {progress.elapsed_s:.0f} s ")

    try:
        return replay_many(requests, configs, args.workers, on_done=on_done)
    finally:
        progress.close()


def _replay_notes(requests: list[ReplayRequest], args: argparse.Namespace) -> dict[str, str]:
    """How to read the replays beside the curve (lru only)."""
    if args.policy != "lru":
        return {"note": "the one-pass curve models lru only"}
    notes = {}
    if args.convention == "slots":
        longest = max(-(-r.seq_len // args.page_size) * args.page_size for r in requests)
        notes["bounds"] = (f"slots convention: each request's hits lie between the curve at C - {longest:,} and at "
                           "C (the longest request, whole pages)")
    if args.eviction == "leaf":
        notes["note"] = "whole-leaf eviction may evict more than needed; the curve does not model it"
    return notes


def _result_fields(result: Any) -> dict[str, Any]:
    return {"hit_rate": result.hit_rate, "hit_tokens": result.num_hit_tokens,
            "evicted_tokens": result.num_evicted_tokens, "peak_usage_tokens": result.peak_usage_tokens,
            "num_skipped": result.num_skipped, "wall_s": result.wall_s}


def _replay_json(args: argparse.Namespace, header: dict[str, str], rows: list[dict[str, Any]],
                 curve: HitRateCurve) -> dict[str, Any]:
    return {
        "source": args.source, "num_requests": curve.num_requests, "num_prompt_tokens": curve.num_prompt_tokens,
        "page_size": args.page_size, "eviction": args.eviction, "convention": args.convention,
        "policy": args.policy, "replayed": not args.curve_only, "notes": header,
        "curve": {"exactness": EXACTNESS, "working_set_tokens": curve.working_set_tokens,
                  "max_hit_tokens": curve.max_hit_tokens, "max_hit_rate": curve.max_hit_rate,
                  "saturation_tokens": curve.saturation_tokens},
        "rows": rows,
    }
