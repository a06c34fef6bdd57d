"""Text for `kvscope plan` and `kvscope replay`: pure functions from results to strings.

Replay rows are plain dicts (the same ones `--json` prints), so this module needs no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvscope.planning.curve import EXACTNESS, HitRateCurve
from kvscope.planning.gpu import GpuInfo
from kvscope.planning.memory_math import GIB
from kvscope.planning.plan import MemoryPlan


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"


def count(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def short_tokens(n: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def gpu_line(gpu: GpuInfo) -> str:
    return f"GPU {gpu.gpu_index}: {gpu.name}, {gib(gpu.total_bytes)} total, {gib(gpu.free_bytes)} free"


# -- plan ----------------------------------------------------------------------------------------


def format_plan(plan: MemoryPlan, gpu_lines: Sequence[str]) -> str:
    i, sg, vl = plan.inputs, plan.sglang, plan.vllm
    head = [
        f"model            {i.model.name}: {i.model.describe()}",
        *(f"                 {line}" for line in gpu_lines),
        f"TP / KV dtype    {i.tp_size} / {plan.kv_dtype}",
        f"weights          {gib(i.weights_per_gpu_bytes)} per GPU"
        + (f" ({gib(i.model.weights_bytes or 0)} in all)" if i.tp_size > 1 else ""),
        f"bytes per token  {bytes_per_token_text(plan)}",
        "",
    ]
    ctx = f"requests @ {i.context_len:,}"
    rows = [
        ("", "SGLang", "vLLM"),
        (
            "memory knob",
            f"mem_fraction_static {sg.mem_fraction_static}",
            "n/a" if vl is None else f"gpu_memory_utilization {vl.gpu_memory_utilization}",
        ),
        ("of", f"{gib(i.gpu_free_bytes)} free at start", f"{gib(i.gpu_total_bytes)} total"),
        ("KV memory", gib(sg.kv_pool_bytes), "n/a" if vl is None else gib(max(vl.kv_cache_bytes, 0))),
        (
            "max KV tokens",
            count(sg.max_total_num_tokens) + (f" + SWA {sg.swa_tokens:,}" if sg.swa_tokens else ""),
            "n/a" if vl is None else count(vl.num_tokens),
        ),
        (
            "pages / blocks",
            f"{sg.num_pages:,} of {sg.page_size}",
            "n/a" if vl is None else f"{vl.num_gpu_blocks:,} of {vl.block_size}",
        ),
        (ctx, count(plan.sglang_requests_at_context), count(plan.vllm_requests_at_context)),
    ]
    width = max(len(r[1]) for r in rows) + 2
    table = [f"{a:<17}{b:<{width}}{c}" for a, b, c in rows]
    return "\n".join(head + table + plan_notes(plan))


def bytes_per_token_text(plan: MemoryPlan) -> str:
    tb = plan.token_bytes
    if not tb.num_swa_layers:
        return f"{tb.all_layers_bytes:,} ({tb.all_layers_bytes / 1024:,.1f} KiB)"
    ratio = plan.inputs.swa_full_tokens_ratio
    return (
        f"{tb.full_bytes:,} in {tb.num_full_layers} full layers + {tb.swa_bytes:,} in {tb.num_swa_layers} "
        f"SWA layers; SGLang cell {plan.sglang.cell_bytes:,.0f} (SWA pool at {ratio} of the full pool)"
    )


def plan_notes(plan: MemoryPlan) -> list[str]:
    notes = []
    if plan.vllm is None:
        notes.append("vLLM: hybrid SWA layer groups are not modelled")
    elif plan.vllm.kv_cache_bytes <= 0:
        notes.append("vLLM: no memory left for the KV cache (it would refuse to start)")
    elif not plan.inputs.vllm_activation_bytes:
        notes.append("vLLM: activation memory not subtracted (vLLM profiles it; pass --vllm-activation-gib)")
    return [""] + [f"note: {n}" for n in notes] if notes else []


# -- replay --------------------------------------------------------------------------------------


def format_replay(
    header: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    curve: HitRateCurve | None,
    isolated: HitRateCurve | None = None,
) -> str:
    """The replay's text; with `isolated` (a scoped replay) the table compares global sharing
    with the scoped cache, and the isolated one-pass curve with the global one."""
    lines = [f"{k:<13} {v}" for k, v in header.items()]
    if curve is not None:
        lines += [
            f"{'one-pass':<13} working set {short_tokens(curve.working_set_tokens)} tokens; unbounded cache: hit rate "
            f"{curve.max_hit_rate:.2%}, reached at {short_tokens(curve.saturation_tokens)} tokens",
            f"{'':<13} {EXACTNESS}",
        ]
    if isolated is not None:
        lines.append(
            f"{'isolated':<13} one pass with keys per principal (k = inf, no pinned, dedup off): working set "
            f"{short_tokens(isolated.working_set_tokens)} tokens; unbounded cache: hit rate "
            f"{isolated.max_hit_rate:.2%}, reached at {short_tokens(isolated.saturation_tokens)} tokens"
        )
    lines += ["", _replay_table(rows, SCOPED_COLUMNS if isolated is not None else COLUMNS)]
    return "\n".join(lines)


COLUMNS = (
    "capacity",
    "hit rate",
    "hit tokens",
    "evicted",
    "peak usage",
    "skipped",
    "replay s",
    "one-pass",
    "replay - one-pass",
)
SCOPED_COLUMNS = (
    "capacity",
    "global hit",
    "cross-principal",
    "scoped hit",
    "cost",
    "scoped evicted",
    "scoped skipped",
    "one-pass global",
    "one-pass isolated",
    "isolation cost",
)


def _replay_table(rows: Sequence[dict[str, Any]], names: Sequence[str] = COLUMNS) -> str:
    columns = [(name, ">") for name in names]
    cells = [[_cell(row, name) for name, _ in columns] for row in rows]
    widths = [max(len(name), *(len(c[k]) for c in cells)) for k, (name, _) in enumerate(columns)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*(name for name, _ in columns)), *(fmt.format(*c) for c in cells)])


def _cell(row: dict[str, Any], name: str) -> str:
    replayed = row.get("hit_rate") is not None
    curve_rate = row.get("curve_hit_rate")
    if name in SCOPED_COLUMNS and name not in COLUMNS:
        return _scoped_cell(row, name)
    value: dict[str, str] = {
        "capacity": f"{row['capacity']:,}",
        "hit rate": f"{row['hit_rate']:.2%}" if replayed else "-",
        "hit tokens": f"{row['hit_tokens']:,}" if replayed else "-",
        "evicted": f"{row['evicted_tokens']:,}" if replayed else "-",
        "peak usage": f"{row['peak_usage_tokens']:,}" if replayed else "-",
        "skipped": f"{row['num_skipped']:,}" if replayed else "-",
        "replay s": f"{row['wall_s']:.2f}" if replayed else "-",
        "one-pass": f"{curve_rate:.2%}" if curve_rate is not None else "-",
        "replay - one-pass": (
            f"{row['hit_tokens'] - row['curve_hit_tokens']:+,} tok" if replayed and curve_rate is not None else "-"
        ),
    }
    return value[name]


def _scoped_cell(row: dict[str, Any], name: str) -> str:
    """A cell of the scoped table: global sharing vs the scoped cache, replays and one-pass curves."""
    replayed = row.get("scoped_hit_rate") is not None
    curve_rate, isolated_rate = row.get("curve_hit_rate"), row.get("isolated_curve_hit_rate")
    gap = None if curve_rate is None or isolated_rate is None else curve_rate - isolated_rate
    value: dict[str, str] = {
        "global hit": f"{row['hit_rate']:.2%}" if replayed else "-",
        "cross-principal": f"{row['cross_hit_tokens'] / max(row['hit_tokens'], 1):.1%} of hits" if replayed else "-",
        "scoped hit": f"{row['scoped_hit_rate']:.2%}" if replayed else "-",
        "cost": f"{100 * row['scoped_cost_hit_rate']:+.2f} pp" if replayed else "-",
        "scoped evicted": f"{row['scoped_evicted_tokens']:,}" if replayed else "-",
        "scoped skipped": f"{row['scoped_num_skipped']:,}" if replayed else "-",
        "one-pass global": f"{curve_rate:.2%}" if curve_rate is not None else "-",
        "one-pass isolated": f"{isolated_rate:.2%}" if isolated_rate is not None else "-",
        "isolation cost": f"{100 * gap:+.2f} pp" if gap is not None else "-",
    }
    return value[name]
