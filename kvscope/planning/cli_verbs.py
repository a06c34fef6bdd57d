"""The `kvscope plan` and `kvscope replay` verbs: argument parsing and handlers.

kvscope/cli.py adds them with `add_plan_parser(verbs)` and `add_replay_parser(verbs)`. Handlers
return the exit code and raise ValueError (one line) on bad input; cli.main prints
`kvscope <verb>: error: ...` and exits 2. Torch loads only when `replay` runs replays.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any, TextIO

from kvscope.planning.curve import EXACTNESS, HitRateCurve, one_pass_curve
from kvscope.planning.gpu import probe_gpus
from kvscope.planning.memory_math import GIB, KV_DTYPES
from kvscope.planning.plan import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_MEM_FRACTION_STATIC, PlanInputs, plan_memory
from kvscope.planning.presets import PRESETS, resolve_model
from kvscope.planning.report import format_plan, format_replay, gpu_line
from kvscope.planning.requests import ReplayRequest, load_requests

SubParsers = Any  # argparse._SubParsersAction, private in typeshed
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


# -- plan ----------------------------------------------------------------------------------------


def add_plan_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    plan = subparsers.add_parser(
        "plan",
        help="KV bytes per token and how many tokens / requests fit, for a model on a GPU",
        description="KV-cache capacity of a model on a GPU: bytes per token, SGLang's max_total_num_tokens and "
        "pages, vLLM's GPU blocks, and how many requests of a context length fit at once. GPU memory comes "
        "from NVML for the visible GPUs (the smallest of the first --tp ones), or from --gpu-mem.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    plan.add_argument("--model", required=True, metavar="NAME|CONFIG",
                      help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json file")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    plan.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, metavar="DTYPE",
                      help=f"KV cache dtype ({', '.join(KV_DTYPES)}); auto = the model's dtype")
    plan.add_argument("--gpu-mem", type=float, metavar="GIB",
                      help="memory per GPU in GiB (SGLang: free at start; vLLM: total); default: NVML")
    plan.add_argument("--weights-gib", type=float, metavar="GIB",
                      help="the whole model's weights in GiB (all TP ranks); default: the preset's")
    plan.add_argument("--page-size", type=int, default=1, help="SGLang tokens per page")
    plan.add_argument("--mem-fraction-static", type=float, default=DEFAULT_MEM_FRACTION_STATIC,
                      help="SGLang: share of the memory free at start for weights + KV")
    plan.add_argument("--swa-full-tokens-ratio", type=float, default=0.8,
                      help="SGLang hybrid SWA: SWA pool tokens per full pool token")
    plan.add_argument("--context-len", type=int, default=8192, help="tokens per request (prompt + output)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                      help="vLLM: share of the GPU's total memory for the instance")
    plan.add_argument("--block-size", type=int, default=16, help="vLLM tokens per block")
    plan.add_argument("--vllm-activation-gib", type=float, default=0.0, metavar="GIB",
                      help="vLLM: activation peak of its profile run, subtracted from its KV memory")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=run_plan)
    return plan


def run_plan(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
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


def add_replay_parser(subparsers: SubParsers) -> argparse.ArgumentParser:
    replay = subparsers.add_parser(
        "replay",
        help="hit rate vs cache capacity for a trace or a capture: replays and the one-pass curve",
        description="Replay a request stream through the radix cache alone (no model) at each capacity, in "
        "parallel processes, and print the hit rate, evicted tokens and peak usage per capacity beside the "
        f"one-pass stack-distance curve ({EXACTNESS}). A capture is replayed by regenerating its run's "
        "request stream from the run's recorded workload config.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    replay.add_argument("source", help="a JSONL trace, or a capture (SQLite file or SQLAlchemy URL)")
    replay.add_argument("--capacities", type=parse_capacities, metavar="LIST",
                        help="comma-separated capacities in tokens (200000, 200k, 1.5M), floored to pages; "
                        "default: 12 log-spaced from 1%% to 100%% of the working set")
    replay.add_argument("--page-size", type=int, default=1, help="tokens per KV page (a power of two)")
    replay.add_argument("--eviction", default="page", choices=["page", "leaf"],
                        help="page: only the pages needed, the curve's model; leaf: SGLang's whole leaves")
    replay.add_argument("--convention", default="slots", choices=["slots", "tree"],
                        help="slots: the pool holds CAPACITY slots shared with the request in flight "
                        "(bench_radix); tree: the tree holds CAPACITY tokens between requests (the curve's)")
    replay.add_argument("--policy", default="lru",
                        help="eviction policy: lru, lfu, fifo, mru, filo, priority, slru (the one-pass curve is lru's)")
    replay.add_argument("--workers", type=int, help="worker processes (default: one per capacity, at most the CPUs)")
    replay.add_argument("--run-id", type=int, help="the run of a capture to replay (default: the latest)")
    replay.add_argument("--curve-only", action="store_true", help="only the one-pass curve, no replays")
    replay.add_argument("--json", action="store_true", help="print the results as JSON")
    replay.set_defaults(func=run_replay)
    return replay


def parse_capacities(text: str) -> list[int]:
    values = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgG]?)", item)
        if not match:
            raise argparse.ArgumentTypeError(f"{item!r} is not a token count (write 200000, 200k or 1.5M)")
        values.append(int(float(match[1]) * _SUFFIXES[match[2].lower()]))
    if not values:
        raise argparse.ArgumentTypeError("no capacities given")
    return values


def run_replay(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
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
    from kvscope.planning.brute_force import ReplayConfig, replay_many

    configs = [ReplayConfig(c, args.page_size, args.eviction, args.convention, args.policy) for c in capacities]
    progress = Progress(len(configs), err)
    try:
        return replay_many(requests, configs, args.workers, on_done=progress)
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


class Progress:
    """`[###...] 3/12 capacities, 41 s` on stderr, once replays have run a second, on a terminal only."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total, self.out, self.start = total, out, time.monotonic()
        self.live = out.isatty()
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.monotonic() - self.start
        if not self.live or elapsed < 1.0:
            return
        filled = 30 * done // max(total, 1)
        self.out.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} capacities, {elapsed:.0f} s ")
        self.out.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.out.write("\n")
