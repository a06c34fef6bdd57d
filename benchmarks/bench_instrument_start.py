"""How long `kvscope instrument` takes before the engine's command starts, per checkout of kvscope.

    .venv/bin/python benchmarks/bench_instrument_start.py [--before PATH [--before-label TEXT]] [--runs N] [--no-write]

Each round runs, in turn (alternating, so a busy machine weighs on each alike): a bare `python -c pass`,
then `python -m kvscope instrument --capture NEW_FILE -- true` with each checkout first on PYTHONPATH
(this one; --before: another, e.g. a worktree of the commit before). `instrument` execs `true`, so a run's
wall time is the verb's start (imports, parsing, checks) plus exec. Also per checkout: the modules
`-X importtime` shows the verb importing (their cumulative time) and whether it loaded numpy, pandas,
SQLAlchemy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import Figure, command_line, machine, this_run, write_figures  # noqa: E402

HEAVY = ("numpy", "pandas", "sqlalchemy")


def instrument_argv(capture: Path) -> list[str]:
    return [sys.executable, "-m", "kvscope", "instrument", "--capture", str(capture), "--", "true"]


def env_for(checkout: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCOPE_", "VLLM_PLUGINS"))}
    return {**clean, "PYTHONPATH": str(checkout)}


def wall_s(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, cwd=cwd, check=True, capture_output=True, timeout=300)
    return time.perf_counter() - start


def import_profile(checkout: Path, tmp: Path) -> tuple[float, list[str]]:
    """The verb's imports by -X importtime: their total cumulative time (s) and the heavy ones loaded."""
    argv = [sys.executable, "-X", "importtime", *instrument_argv(tmp / "profile.db")[1:]]
    out = subprocess.run(argv, env=env_for(checkout), cwd=tmp, capture_output=True, text=True, timeout=300)
    top_us, heavy = 0, set()
    for line in out.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if not line.startswith("import time:") or len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        name = parts[2].strip()
        if len(parts[2]) - len(parts[2].lstrip()) == 1:  # NOTE: top level (nested imports are inside it)
            top_us += int(parts[1])
        if name.split(".")[0] in HEAVY:
            heavy.add(name.split(".")[0])
    return top_us / 1e6, sorted(heavy)


ABOUT = (
    "`kvscope instrument`'s wall time from its start to the engine's exec (the engine here: `true`), "
    "beside bare python."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout of kvscope to time beside this one")
    parser.add_argument("--before-label", default="", help="what --before holds, for the section")
    parser.add_argument("--runs", type=int, default=10, help="rounds")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md as it is")
    args = parser.parse_args()
    checkouts = {"this checkout": ROOT, **({"--before": args.before.resolve()} if args.before else {})}
    times: dict[str, list[float]] = {"bare python -c pass": [], **{name: [] for name in checkouts}}
    with tempfile.TemporaryDirectory(prefix="kvscope-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        for run in range(args.runs):
            times["bare python -c pass"].append(wall_s([sys.executable, "-c", "pass"], dict(os.environ), tmp))
            for name, checkout in checkouts.items():
                times[name].append(wall_s(instrument_argv(tmp / f"c{run}-{len(name)}.db"), env_for(checkout), tmp))
        profiles = {name: import_profile(checkout, tmp) for name, checkout in checkouts.items()}
    rows, figures = [], []
    for name, values in times.items():
        imports_s, heavy = profiles.get(name, (None, None))
        shown_imports = "" if imports_s is None else f"{imports_s:.3f}"
        shown_heavy = "" if heavy is None else (", ".join(heavy) or "none")
        rows.append(
            f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} "
            f"| {shown_imports} | {shown_heavy} |"
        )
        label = f"--before: {args.before_label or args.before}" if name == "--before" else name
        value = f"{statistics.median(values):.3f} s median ({min(values):.3f} to {max(values):.3f} s)"
        if imports_s is not None:
            value += f"; imports {shown_imports} s; numpy, pandas, SQLAlchemy loaded: {shown_heavy}"
        figures.append(Figure(f"start to the engine's exec, {label}", value))
    body = "\n".join(
        [
            f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC with `{command_line()}`"
            + (f" (--before: {args.before_label or args.before})" if args.before else "")
            + ".",
            "",
            f"- machine: {machine('cpu')}",
            "",
            f"Wall time from starting `python -m kvscope instrument --capture NEW_FILE -- true` to `true`'s end "
            f"(the verb execs it: its start is the engine's), {args.runs} alternating rounds; import time is the sum "
            "of the top-level imports' cumulative times in one `-X importtime` run.",
            "",
            "| what ran | median (s) | min (s) | max (s) | imports (s) | numpy, pandas, SQLAlchemy loaded |",
            "|---|---:|---:|---:|---:|---|",
            *rows,
        ]
    )
    print(body)
    if not args.no_write:
        write_figures("bench_instrument_start", ABOUT, figures, this_run("cpu"))


if __name__ == "__main__":
    main()
