"""Allocator throughput: decode-like and prefill-like patterns, page size 1, paged, SWA.

    .venv/bin/python benchmarks/bench_alloc.py [--quick] [--device auto|cpu|cuda] [--no-write]

Prints a Markdown table; with --write (the default) also sets its rows in the
`## bench_alloc` table of benchmarks/RESULTS.md.

NOTE: what one timed step is
    decode:  one allocation for the whole batch (alloc(256) at page size 1, alloc_decode
             when paged); requests that reached their length are freed inside one free
             group, one free() per request; newcomers take their rows with one prefill
             allocation (alloc / alloc_extend from an empty prefix).
    prefill: one allocation of 8 requests x 2048 new tokens on top of resident prefixes
             of random, page-unaligned lengths (alloc / alloc_extend with last_loc = the
             prefix's last slot), then one free() per request inside one free group.
The slot tables (like req_to_token) live on the device and their upkeep is timed too, as
it is in a scheduler; all of it is batched per step. check_integrity runs once per case,
after timing, with every slot the benchmark still holds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, NamedTuple

import numpy as np
import torch
from _results import Figure, command_line, machine, this_run, write_figures

from kvscope.mem import SWATokenToKVPoolAllocator, TokenAllocator, make_token_allocator, resolve_device

Allocator = TokenAllocator
INDEX = torch.int64

DECODE_BATCH_SIZE = 256
DECODE_PROMPT_LENS = (32, 1024)  # uniform, inclusive
DECODE_OUTPUT_LENS = (32, 1024)
DECODE_MAX_CONTEXT_LEN = DECODE_PROMPT_LENS[1] + DECODE_OUTPUT_LENS[1]
PREFILL_BATCH_SIZE = 8
PREFILL_EXTEND_LEN = 2048
NUM_PREFIXES = 32
MAX_PREFIX_LEN = 4096  # prefix lengths uniform in [0, MAX_PREFIX_LEN); every 8th is empty


@dataclass(frozen=True)
class Case:
    pattern: Literal["decode", "prefill"]
    kind: Literal["token", "paged", "swa"]
    page_size: int
    strict: bool = False

    @property
    def label(self) -> str:
        return {"token": "TokenToKV", "paged": "PagedTokenToKV", "swa": "SWATokenToKV"}[self.kind]


CASES = [
    *(
        Case(p, k, ps)
        for p in ("decode", "prefill")
        for k, ps in (("token", 1), ("paged", 16), ("paged", 64), ("swa", 16))
    ),
    Case("decode", "paged", 16, strict=True),
    Case("prefill", "paged", 16, strict=True),
]


@dataclass(frozen=True)
class Scale:
    num_warmup_steps: dict[str, int]
    num_timed_steps: dict[str, int]  # per repeat
    num_repeats: int


SCALES = {
    "default": Scale({"decode": 300, "prefill": 30}, {"decode": 6000, "prefill": 800}, 5),
    "quick": Scale({"decode": 100, "prefill": 10}, {"decode": 2500, "prefill": 250}, 3),
}


@dataclass
class Counts:
    num_steps: int = 0
    num_alloc_calls: int = 0
    num_alloc_tokens: int = 0
    num_free_calls: int = 0
    num_freed_tokens: int = 0

    def minus(self, other: Counts) -> Counts:
        pairs = zip(vars(self).values(), vars(other).values(), strict=True)
        return Counts(*(mine - theirs for mine, theirs in pairs))


class Figures(NamedTuple):
    steps_per_s: float
    alloc_calls_per_s: float
    alloc_tokens_per_s: float
    free_calls_per_s: float
    freed_tokens_per_s: float
    spread: float  # (max - min) / median of steps/s over the repeats


def make_allocator(case: Case, total_size: int, device: torch.device) -> Allocator:
    if case.kind == "swa":
        return SWATokenToKVPoolAllocator(total_size, total_size, case.page_size, device, strict=case.strict)
    return make_token_allocator(total_size, case.page_size, device, strict=case.strict)


class Workload:
    """Shared by both patterns: allocation calls that count what they do."""

    def __init__(self, case: Case, total_size: int, device: torch.device, seed: int) -> None:
        self.allocator = make_allocator(case, total_size, device)
        self.page_size = case.page_size
        self.device = device
        self.rng = np.random.default_rng(seed)
        self.counts = Counts()

    def extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        if self.page_size == 1:
            slots = self.allocator.alloc(num_tokens)
        else:
            slots = self.allocator.alloc_extend(prefix_lens, seq_lens, last_loc, num_tokens)
        return self._counted(slots, num_tokens)

    def decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            slots = self.allocator.alloc(len(seq_lens))
        else:
            slots = self.allocator.alloc_decode(seq_lens, last_loc)
        return self._counted(slots, len(seq_lens))

    def _counted(self, slots: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
        if slots is None:
            raise RuntimeError(f"pool exhausted allocating {num_tokens} tokens; size it larger")
        self.counts.num_alloc_calls += 1
        self.counts.num_alloc_tokens += num_tokens
        return slots

    def free_group(self, pieces: list[torch.Tensor]) -> None:
        self.allocator.free_group_begin()
        for slots in pieces:
            self.allocator.free(slots)
        self.allocator.free_group_end()
        self.counts.num_free_calls += len(pieces)
        self.counts.num_freed_tokens += sum(len(p) for p in pieces)


def scatter_rows(table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor) -> None:
    """table[rows[i], 0:lens[i]] = the i-th piece of `slots`, in one indexed write."""
    starts = torch.cumsum(lens, 0) - lens
    row_of_token = torch.repeat_interleave(rows, lens, output_size=len(slots))
    start_of_token = torch.repeat_interleave(starts, lens, output_size=len(slots))
    positions = torch.arange(len(slots), dtype=INDEX, device=slots.device) - start_of_token
    table[row_of_token, positions] = slots


class DecodeWorkload(Workload):
    """DECODE_BATCH_SIZE running requests; row i of `slot_table` holds request i's slots."""

    def __init__(self, case: Case, device: torch.device, seed: int) -> None:
        total_size = DECODE_BATCH_SIZE * (DECODE_MAX_CONTEXT_LEN + 64)
        super().__init__(case, total_size, device, seed)
        num_rows = DECODE_BATCH_SIZE
        self.rows_t = torch.arange(num_rows, device=device)
        self.slot_table = torch.zeros((num_rows, DECODE_MAX_CONTEXT_LEN), dtype=INDEX, device=device)
        self.seq_lens = np.zeros(num_rows, dtype=np.int64)
        self.target_lens = np.zeros(num_rows, dtype=np.int64)
        self.seq_lens_t = torch.zeros(num_rows, dtype=INDEX, device=device)
        self.last_loc_t = torch.full((num_rows,), -1, dtype=INDEX, device=device)
        self.admit(np.arange(num_rows), in_flight=True)
        self.counts = Counts()

    def admit(self, rows: np.ndarray, *, in_flight: bool = False) -> None:
        """Prefill newcomers into `rows`. `in_flight`: start them part-way through their
        output, as a batch that has been running a while (the setup's first batch)."""
        prompt_lens = self.rng.integers(*DECODE_PROMPT_LENS, size=len(rows), endpoint=True)
        output_lens = self.rng.integers(*DECODE_OUTPUT_LENS, size=len(rows), endpoint=True)
        done_lens = self.rng.integers(0, output_lens) if in_flight else 0
        fill_lens = prompt_lens + done_lens
        self.seq_lens[rows], self.target_lens[rows] = fill_lens, prompt_lens + output_lens
        rows_t = torch.as_tensor(rows, device=self.device)
        lens_t = torch.as_tensor(fill_lens, device=self.device)
        num_tokens = int(fill_lens.sum())
        no_prefix = torch.zeros_like(lens_t)
        slots = self.extend(no_prefix, lens_t, no_prefix - 1, num_tokens)
        scatter_rows(self.slot_table, rows_t, lens_t, slots)
        self.seq_lens_t[rows_t] = lens_t
        self.last_loc_t[rows_t] = slots[torch.cumsum(lens_t, 0) - 1]

    def step(self) -> None:
        slots = self.decode(self.seq_lens_t + 1, self.last_loc_t)
        self.slot_table[self.rows_t, self.seq_lens_t] = slots
        self.seq_lens_t += 1
        self.last_loc_t = slots
        self.seq_lens += 1
        done = np.flatnonzero(self.seq_lens >= self.target_lens)
        if len(done):
            self.free_group([self.slot_table[row, : self.seq_lens[row]] for row in done])
            self.admit(done)
        self.counts.num_steps += 1

    def owned_slots(self) -> torch.Tensor:
        return torch.cat([self.slot_table[row, :fill_len] for row, fill_len in enumerate(self.seq_lens)])


class PrefillWorkload(Workload):
    """Resident prefixes (held all along); each step extends 8 of them, then frees the rest.

    NOTE: request i of a step owns positions [p_i, p_i + 2048) of prefix p_i's row, but
    positions [p_i, ceil_ps(p_i)) sit on the prefix's last page, which the prefix keeps:
    only slots from ceil_ps(p_i) on are freed (page size 1: all of them).
    """

    def __init__(self, case: Case, device: torch.device, seed: int) -> None:
        total_size = 2 * NUM_PREFIXES * MAX_PREFIX_LEN
        super().__init__(case, total_size, device, seed)
        lens = self.rng.integers(0, MAX_PREFIX_LEN, size=NUM_PREFIXES)
        lens[::8] = 0
        self.prefix_lens = lens
        self.prefix_lens_t = torch.as_tensor(lens, device=device)
        self.prefix_slot_table = torch.zeros((NUM_PREFIXES, MAX_PREFIX_LEN), dtype=INDEX, device=device)
        rows_t = torch.arange(NUM_PREFIXES, device=device)
        zeros = torch.zeros_like(self.prefix_lens_t)
        slots = self.extend(zeros, self.prefix_lens_t, zeros - 1, int(lens.sum()))
        scatter_rows(self.prefix_slot_table, rows_t, self.prefix_lens_t, slots)
        last = self.prefix_slot_table[rows_t, (self.prefix_lens_t - 1).clamp(min=0)]
        self.prefix_last_loc_t = torch.where(self.prefix_lens_t > 0, last, -1)
        self.counts = Counts()

    def step(self) -> None:
        picked = self.rng.choice(NUM_PREFIXES, size=PREFILL_BATCH_SIZE, replace=False)
        picked_t = torch.as_tensor(picked, device=self.device)
        prefix_lens_t = self.prefix_lens_t[picked_t]
        slots = self.extend(
            prefix_lens_t,
            prefix_lens_t + PREFILL_EXTEND_LEN,
            self.prefix_last_loc_t[picked_t],
            PREFILL_BATCH_SIZE * PREFILL_EXTEND_LEN,
        )
        ps = self.page_size
        kept_lens = -(-self.prefix_lens[picked] // ps) * ps - self.prefix_lens[picked]
        pieces = [
            slots[i * PREFILL_EXTEND_LEN + kept : (i + 1) * PREFILL_EXTEND_LEN]
            for i, kept in enumerate(kept_lens.tolist())
        ]
        self.free_group(pieces)
        self.counts.num_steps += 1

    def owned_slots(self) -> torch.Tensor:
        table, prefix_lens = self.prefix_slot_table, self.prefix_lens
        return torch.cat([table[row, :prefix_len] for row, prefix_len in enumerate(prefix_lens)])


WORKLOADS = {"decode": DecodeWorkload, "prefill": PrefillWorkload}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: Case, scale: Scale, device: torch.device, seed: int) -> Figures:
    workload = WORKLOADS[case.pattern](case, device, seed)
    for _ in range(scale.num_warmup_steps[case.pattern]):
        workload.step()
    timings: list[tuple[float, Counts]] = []
    for _ in range(scale.num_repeats):
        synchronize(device)
        before, start_s = Counts(**vars(workload.counts)), time.perf_counter()
        for _ in range(scale.num_timed_steps[case.pattern]):
            workload.step()
        synchronize(device)
        timings.append((time.perf_counter() - start_s, workload.counts.minus(before)))
    workload.allocator.check_integrity(workload.owned_slots())
    return figures_from(timings)


def figures_from(timings: list[tuple[float, Counts]]) -> Figures:
    steps_per_s = sorted(counts.num_steps / elapsed_s for elapsed_s, counts in timings)
    elapsed_s, counts = sorted(timings, key=lambda t: t[1].num_steps / t[0])[len(timings) // 2]
    return Figures(
        counts.num_steps / elapsed_s,
        counts.num_alloc_calls / elapsed_s,
        counts.num_alloc_tokens / elapsed_s,
        counts.num_free_calls / elapsed_s,
        counts.num_freed_tokens / elapsed_s,
        (steps_per_s[-1] - steps_per_s[0]) / statistics.median(steps_per_s),
    )


def fmt(rate: float) -> str:
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if rate >= scale:
            return f"{rate / scale:.2f}{suffix}"
    return f"{rate:.1f}"


def results_table(results: list[tuple[Case, Figures]]) -> str:
    lines = [
        "| pattern | allocator | page size | strict | steps/s | alloc calls/s | tokens allocated/s "
        "| free calls/s | slots freed/s | spread |",
        "|---|---|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    for case, fig in results:
        rates = (
            fig.steps_per_s,
            fig.alloc_calls_per_s,
            fig.alloc_tokens_per_s,
            fig.free_calls_per_s,
            fig.freed_tokens_per_s,
        )
        strict = "on" if case.strict else "off"
        lines.append(
            f"| {case.pattern} | {case.label} | {case.page_size} | {strict} | "
            + " | ".join(fmt(rate) for rate in rates)
            + f" | {fig.spread:.0%} |"
        )
    return "\n".join(lines)


def strict_table(results: list[tuple[Case, Figures]]) -> str:
    by_case = dict(results)
    lines = [
        "| pattern | allocator | page size | steps/s strict off | steps/s strict on | cost |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for case, on in results:
        off = by_case.get(Case(case.pattern, case.kind, case.page_size)) if case.strict else None
        if off is not None:
            lines.append(
                f"| {case.pattern} | {case.label} | {case.page_size} | {fmt(off.steps_per_s)} "
                f"| {fmt(on.steps_per_s)} | {off.steps_per_s / on.steps_per_s:.2f}x slower |"
            )
    return "\n".join(lines)


def section_body(
    results: list[tuple[Case, Figures]], scale_name: str, scale: Scale, device: torch.device, total_s: float
) -> str:
    steps = ", ".join(
        f"{p} {scale.num_warmup_steps[p]} warm-up + {scale.num_repeats} x {scale.num_timed_steps[p]} timed steps"
        for p in WORKLOADS
    )
    parts = [
        f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command_line()}`",
        f"- machine: {machine(device.type)}",
        f"- scale: {scale_name} ({steps}); whole run {total_s:.0f} s",
        "",
        results_table(results),
        "",
        "Strict mode cost (same pattern, strict off vs on):",
        "",
        strict_table(results),
        "",
        "Reading the tables:",
        "",
        "- Figures come from the repeat with the median steps/s; `spread` is (max - min) / "
        "median of steps/s over the repeats. Setup, warm-up and `check_integrity` are untimed.",
        f"- decode: {DECODE_BATCH_SIZE} requests; a step is one allocation for the batch, plus, "
        "when requests finished, one free group (one `free` per request) and one prefill "
        f"allocation for the newcomers (prompts {DECODE_PROMPT_LENS[0]}-{DECODE_PROMPT_LENS[1]}, "
        f"outputs {DECODE_OUTPUT_LENS[0]}-{DECODE_OUTPUT_LENS[1]} tokens). `tokens allocated/s` "
        f"counts both kinds; decode tokens/s alone = {DECODE_BATCH_SIZE} x steps/s.",
        f"- prefill: a step is one allocation of {PREFILL_BATCH_SIZE} x {PREFILL_EXTEND_LEN} "
        f"tokens on top of resident prefixes (0-{MAX_PREFIX_LEN} tokens, page-unaligned), then "
        "one free group; the positions that share the prefix's last page stay with the prefix, "
        "so paged rows free slightly fewer slots than they allocate.",
        "- `slots freed/s` counts the slots passed to `free`.",
        "- SWA: full and SWA pools of equal size, no window freeing (`free_swa`): the rows show "
        "the cost of the lockstep pools and the full-to-SWA mapping.",
        "- CPU runs use one torch thread (`--threads`, default 1): the allocator's tensors are "
        "small, and on a 2-core VM waking a second intra-op thread stalled single steps for "
        "~8 ms (a step is ~60 µs), so figures swung by up to 100x between runs.",
    ]
    if device.type != "cuda":
        parts += [
            "",
            "CUDA figures are not recorded yet: no GPU was lent to the task that "
            "recorded this section. Rerun with `--device cuda` on a GPU machine.",
        ]
    return "\n".join(parts)


ABOUT = (
    "Steps per second of kvscope's token allocators on decode-like and prefill-like steps, and what "
    "strict mode costs; CPU only until a GPU run adds its rows."
)


def figures(results: list[tuple[Case, Figures]], device: torch.device) -> list[Figure]:
    """RESULTS.md rows: each case's steps/s and tokens allocated/s, then strict mode's cost."""
    rows = []
    by_case = dict(results)
    for case, fig in results:
        strict = "on" if case.strict else "off"
        name = f"{device.type}, {case.pattern}, {case.label}, page size {case.page_size}, strict {strict}"
        tokens = fmt(fig.alloc_tokens_per_s)
        value = f"{fmt(fig.steps_per_s)} steps/s, {tokens} tokens allocated/s (spread {fig.spread:.0%})"
        rows.append(Figure(name, value))
    for case, on in results:
        off = by_case.get(Case(case.pattern, case.kind, case.page_size)) if case.strict else None
        if off is not None:
            name = f"{device.type}, strict mode's cost, {case.pattern}, {case.label}, page size {case.page_size}"
            rows.append(Figure(name, f"{off.steps_per_s / on.steps_per_s:.2f}x slower (steps/s off / on)"))
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--quick", action="store_true", help="fewer steps: about 10 s on 2 cores")
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="set its rows in the bench_alloc table of benchmarks/RESULTS.md",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: the allocator's tensors are "
        "small, and on few-core VMs waking a second thread stalls for ms)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        sys.exit(f"bench_alloc: {err}")
    torch.set_num_threads(args.threads)
    scale_name = "quick" if args.quick else "default"
    scale = SCALES[scale_name]
    start_s = time.perf_counter()
    results = []
    for case in CASES:
        results.append((case, run_case(case, scale, device, args.seed)))
        print(f"  {case}: {time.perf_counter() - start_s:.1f} s", file=sys.stderr)
    body = section_body(results, scale_name, scale, device, time.perf_counter() - start_s)
    print(body)
    if args.write:
        write_figures("bench_alloc", ABOUT, figures(results, device), this_run(device.type))


if __name__ == "__main__":
    main()
