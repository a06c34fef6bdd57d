"""Shared by the benchmark scripts: the command line, the machine, RESULTS.md's tables, the verdict on
paired ratios, and a clean exit on SIGTERM.

NOTE: RESULTS.md layout: a header (everything before the first "## " line), then one
"## <script>" section per `bench_*.py`, each exactly:

    ## bench_x
                                                    (blank)
    One sentence: what the script measures.
                                                    (blank)
    | figure | value | target | met | date | run |
    |---|---|---|---|---|---|
    | <name> | <value with unit> | <target or empty> | met / not met / unclear / no target | <date> | 1 |
                                                    (blank)
    Runs:
    1. <date> · `<command>` · <machine>

A row's `run` is the number of its line under "Runs:"; a run line with no row left is dropped.
`write_figures` merges: a row whose figure name it is given is replaced in place (with the new run),
the others stay, new names go to the end. The file is both what people read and what is merged,
so `read_section` parses exactly what `render_section` writes.

Run as a script, it adds figures someone reported (see `python benchmarks/_results.py --help`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import re
import shlex
import signal
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

RESULTS_PATH = Path(__file__).with_name("RESULTS.md")
BENCH_DIR = Path(__file__).parent

VERDICTS = ("met", "not met", "unclear", "no target")
COLUMNS = ("figure", "value", "target", "met", "date", "run")

HEADER = """# Benchmark results

One section per script in `benchmarks/` (named after it): one sentence on what it measures, one
table of its current figures, and the runs they come from (date, exact command line, machine and
its load). `met` says whether a figure meets its target: met, not met, unclear (the run cannot
settle it; the value says why) or no target. The method and every figure a script prints are in
the script's docstring and output; this file keeps only the newest figure of each kind.

Rerunning a script replaces the rows it measures and keeps the others. To add figures measured by
hand or reported by someone else, from the repository root:

    python benchmarks/_results.py bench_x --date "2026-12-06 15:10 UTC" --command "CMD" \\
        --machine "Intel Xeon, 2 cores, load average 3.1" --row "FIGURE" "VALUE" "≤ 1 µs" "met"

(`--row NAME VALUE TARGET MET`, repeatable; TARGET `-` with MET `no target`.) Older rounds, with
their full write-ups, are in the history: `git log -p benchmarks/RESULTS.md`.
"""


@dataclass(frozen=True)
class Figure:
    """One row: a figure's name (with its case), its value with unit, its target and verdict."""

    name: str
    value: str
    target: str = ""
    met: str = "no target"

    def __post_init__(self) -> None:
        if not self.name.strip() or not self.value.strip():
            raise ValueError(f"figure {self.name!r}: a name and a value are required")
        if self.met not in VERDICTS:
            raise ValueError(f"figure {self.name!r}: met must be one of {', '.join(VERDICTS)}, not {self.met!r}")
        if (self.met == "no target") != (not self.target.strip()):
            raise ValueError(f"figure {self.name!r}: a target needs a verdict, and a verdict a target")


@dataclass(frozen=True)
class Run:
    """Where figures come from: when, the exact command line, and the machine with its load."""

    date: str
    command: str
    machine: str

    def line(self) -> str:
        return f"{self.date} · `{self.command}` · {self.machine}"


@dataclass(frozen=True)
class Section:
    about: str
    rows: list[tuple[Figure, str]]  # NOTE: (figure, its run's line)


def write_figures(name: str, about: str, figures: list[Figure], run: Run, path: Path = RESULTS_PATH) -> None:
    """Set `figures` (from `run`) in section `## {name}` of RESULTS.md, keeping its other rows.

    `about` replaces the section's sentence; an empty `about` keeps it (a new section needs one).
    """
    names = [figure.name for figure in figures]
    if len(set(names)) != len(names):
        raise ValueError(f"section {name!r}: figure names repeat: {names}")
    text = path.read_text() if path.exists() else HEADER
    old = read_section(text, name)
    about = about.strip() or (old.about if old else "")
    if not about:
        raise ValueError(f"section {name!r} is new: it needs a sentence on what it measures")
    new = {figure.name: figure for figure in figures}
    rows = [(new.pop(f.name), run.line()) if f.name in new else (f, line) for f, line in (old.rows if old else [])]
    rows += [(figure, run.line()) for figure in new.values()]
    _replace_section(name, render_section(Section(about, rows)), path)


def stop_cleanly_on_sigterm() -> None:
    """Make SIGTERM (`kill`, `timeout`, a CI's cancel) leave like Ctrl-C: through the script's `with`
    blocks and `finally` clauses, so the servers it started are stopped. Python's default for SIGTERM
    ends at once and left two vLLM servers running after a killed bench_census_server."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of `values` (paired ratios, say): the
    k-th smallest and k-th largest, with the largest k whose coverage, from the binomial(n, 1/2) law of
    how many values fall below the median, is still at least `confidence`. Returns (low, high,
    coverage); with too few values for that confidence, the whole range and its own coverage.

    NOTE: no assumption on the noise's shape (a shared machine's is skewed: a round slowed by another
    job's burst is far off, one sped up is not); 8 values give at best 99.2% with k = 1, 12 give
    96.1% with k = 3."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("no values")

    def coverage(k: int) -> float:  # P(x(k) <= median <= x(n-k+1)) = 1 - 2 P(Binomial(n, 1/2) < k)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def interval_verdict(ratios: list[float], target: float, *, cost_is_drop: bool) -> tuple[str, str]:
    """The verdict on a cost measured as paired ratios (new / old), from the 95% interval of their
    median (`median_interval`): met when the whole interval's cost is within `target`, not met when
    the whole interval is past it, else unclear. The cost is 1 - ratio when `cost_is_drop` (requests/s:
    a lower rate costs) and ratio - 1 otherwise (CPU per request). Returns (verdict, the interval in
    words for the figure's value)."""
    low, high, cover = median_interval(ratios)
    costs = sorted((1 - low, 1 - high) if cost_is_drop else (low - 1, high - 1))
    words = f"{100 * cover:.1f}% interval of the median cost {100 * costs[0]:+.1f}% to {100 * costs[1]:+.1f}%"
    if cover < 0.95:
        return "unclear", f"{words} (too few pairs for 95%)"
    if costs[1] <= target:
        return "met", words
    if costs[0] > target:
        return "not met", words
    return "unclear", words


def render_section(section: Section) -> str:
    """The section's body (below its heading), in the layout of the module's NOTE."""
    runs: list[str] = []
    for _, line in section.rows:
        if line not in runs:
            runs.append(line)
    table = ["| " + " | ".join(COLUMNS) + " |", "|---|---|---|---|---|---|"]
    for figure, line in section.rows:
        cells = (
            figure.name,
            figure.value,
            figure.target,
            figure.met,
            line.split(" · ", 1)[0],
            str(runs.index(line) + 1),
        )
        table.append("| " + " | ".join(_escape(cell) for cell in cells) + " |")
    run_lines = [f"{i}. {line}" for i, line in enumerate(runs, 1)]
    return "\n".join([section.about, "", *table, "", "Runs:", *run_lines])


def read_section(text: str, name: str) -> Section | None:
    """Parse section `## {name}` of RESULTS.md's text (None when absent); ValueError when it is
    not in the layout of the module's NOTE."""
    body = section_bodies(text).get(name)
    if body is None:
        return None
    lines = body.strip().splitlines()
    table = [line for line in lines if line.startswith("|")]
    matches = (re.match(r"(\d+)\. (.+)$", line) for line in lines)
    runs: dict[str, str] = {m.group(1): m.group(2) for m in matches if m}
    about = " ".join(line for line in lines[: lines.index(table[0])] if line.strip()) if table else ""
    if not about or len(table) < 3 or _cells(table[0]) != list(COLUMNS) or "Runs:" not in lines:
        raise ValueError(f"section {name!r}: not a sentence, a table ({' | '.join(COLUMNS)}) and its runs")
    rows = []
    for line in table[2:]:
        cells = _cells(line)
        if len(cells) != len(COLUMNS) or cells[5] not in runs:
            raise ValueError(f"section {name!r}: row {line!r} has no run line or not {len(COLUMNS)} cells")
        rows.append((Figure(cells[0], cells[1], cells[2], cells[3]), runs[cells[5]]))
    return Section(about, rows)


def section_bodies(text: str) -> dict[str, str]:
    """Each `## name` section's text below its heading, in file order."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = bodies.setdefault(line[3:].strip(), [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in bodies.items()}


def _escape(cell: str) -> str:
    return " ".join(cell.split()).replace("|", "\\|")


def _cells(line: str) -> list[str]:
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", inner)]


def _replace_section(name: str, body: str, path: Path) -> None:
    """Replace (or append) the span of `## {name}`: its heading to the next "## " line or the end."""
    text = path.read_text() if path.exists() else HEADER
    lines = text.splitlines(keepends=True)
    section = f"## {name}\n\n{body.strip()}\n"
    start = next((i for i, line in enumerate(lines) if line.rstrip() == f"## {name}"), None)
    if start is None:
        new_text = f"{text.rstrip()}\n\n{section}"
    else:
        later = range(start + 1, len(lines))
        end = next((j for j in later if lines[j].startswith("## ")), len(lines))
        before, after = "".join(lines[:start]), "".join(lines[end:])
        new_text = before + section + (f"\n{after}" if after else "")
    tmp_path = path.with_suffix(".md.tmp")
    tmp_path.write_text(new_text)
    tmp_path.replace(path)


def now() -> str:
    return f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"


def command_line() -> str:
    """The command that ran this process, as typed from the repository root."""
    python = Path(sys.executable)
    with contextlib.suppress(ValueError):
        python = python.relative_to(Path.cwd())
    return shlex.join([str(python), *sys.argv])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


ENGINES = (("vllm", "vLLM"), ("sglang", "SGLang"))  # NOTE: named in the machine line when imported


def machine(device_type: str = "cpu", load: str = "", extra: str = "") -> str:
    """One line: CPU, cores, Python (torch, vLLM, SGLang where imported), device, `extra`, the load.

    `load` says what the script measured of the machine's load; by default the 1-minute load
    average as the figures are written.
    """
    num_usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    parts = [f"{cpu_model()}, {os.cpu_count()} logical cores ({num_usable_cores} usable)"]
    torch = sys.modules.get("torch")
    python = f"Python {platform.python_version()}"
    if torch is not None:
        python += f", torch {torch.__version__}, torch threads {torch.get_num_threads()}"
    parts.append(python)
    if "cuda" in device_type and torch is not None:
        parts.append(f"device {device_type} ({torch.cuda.get_device_name()}, CUDA {torch.version.cuda})")
    else:
        parts.append(f"device {device_type}")
    loaded = [(name, sys.modules[module]) for module, name in ENGINES if module in sys.modules]
    engines = [f"{name} {getattr(engine, '__version__', '?')}" for name, engine in loaded]
    parts += [*engines, *([extra] if extra else [])]
    parts.append(load or f"load average {os.getloadavg()[0]:.2f} (1 min) as written")
    return "; ".join(parts)


def this_run(device_type: str = "cpu", load: str = "", extra: str = "") -> Run:
    """The Run of this process: now, its command line, this machine (see `machine`)."""
    return Run(now(), command_line(), machine(device_type, load, extra))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Add reported figures to a section of benchmarks/RESULTS.md.")
    parser.add_argument("section", help="the script's name, e.g. bench_probe")
    parser.add_argument("--about", default="", help="the section's sentence (required for a new section)")
    parser.add_argument("--date", required=True, help='when it ran, e.g. "2026-12-06 15:10 UTC"')
    parser.add_argument("--command", required=True, help="the exact command line")
    parser.add_argument("--machine", required=True, help="the machine and its load")
    parser.add_argument(
        "--row", nargs=4, action="append", required=True, metavar=("NAME", "VALUE", "TARGET", "MET"),
        help=f"a figure; TARGET '-' for none; MET one of: {', '.join(VERDICTS)}",
    )  # fmt: skip
    parser.add_argument("--file", type=Path, default=RESULTS_PATH, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (BENCH_DIR / f"{args.section}.py").exists():
        parser.error(f"no script benchmarks/{args.section}.py")
    try:
        figures = [Figure(name, value, "" if target == "-" else target, met) for name, value, target, met in args.row]
        write_figures(args.section, args.about, figures, Run(args.date, args.command, args.machine), args.file)
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
