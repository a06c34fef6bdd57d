"""Shared by the benchmark scripts: the command line, the machine, and RESULTS.md sections.

NOTE: RESULTS.md layout: a header (everything before the first "## " line), then one
"## <name>" section per script. A section runs from its heading to the next "## " line or
the end of the file; `write_section` replaces exactly that span and keeps the rest.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import sys
from pathlib import Path

RESULTS_PATH = Path(__file__).with_name("RESULTS.md")

HEADER = """# Benchmark results

Every section below is written by one script in `benchmarks/` (the section is named after
it), together with the date, the exact command line and the machine it ran on. Figures are
not edited by hand: to refresh a section, rerun its command line; sections of other
scripts are kept as they are.
"""


def write_section(name: str, body: str, path: Path = RESULTS_PATH) -> None:
    """Replace (or append) the section `## {name}` of RESULTS.md with `body`.

    `body` is Markdown without the heading; it may use `###` headings but no `##` ones,
    since a `##` line would end the section.
    """
    if any(line.startswith("## ") for line in body.splitlines()):
        raise ValueError(f"section {name!r}: body must not contain '## ' headings (use '###')")
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


def machine_lines(device_type: str) -> list[str]:
    """Markdown bullet lines describing the machine and the torch build."""
    import torch

    num_usable_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    lines = [
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical cores ({num_usable_cores} usable), "
        f"torch threads {torch.get_num_threads()}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, {platform.system()} {platform.release()}",
        f"- device: {device_type}",
    ]
    if device_type == "cuda":
        lines[-1] += f" ({torch.cuda.get_device_name()}, CUDA {torch.version.cuda})"
    return lines
