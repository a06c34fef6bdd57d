"""The dashboard yields the CPU to the engine it watches: its process runs at a lower scheduling
priority (nice DEFAULT_NICE), so when the machine is short of CPU the engine (and its capture's writer)
go first and the pages wait, not the other way round.

`streamlit run app.py -- --nice N` (or $KVSCOPE_DASHBOARD_NICE=N) picks another niceness; 0 turns it
off. A process cannot lower its own niceness without privilege, so the dashboard only ever raises it.

NOTE: on Linux a niceness belongs to a thread, not to the process: Streamlit runs each session's script
in a thread of its own, made by the server's main thread. Every thread of the process is reniced (and a
thread made later inherits its maker's niceness), not only the one that runs this.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_NICE = 10
MAX_NICE = 19
ENV_NICE = "KVSCOPE_DASHBOARD_NICE"
_TASKS = Path("/proc/self/task")


def requested_nice(argv: list[str] | None = None) -> int:
    """`--nice N` after `streamlit run app.py --`, else $KVSCOPE_DASHBOARD_NICE, else DEFAULT_NICE.
    Raises ValueError (one line) for a value that is not a whole number from 0 to MAX_NICE."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--nice")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    value = args.nice if args.nice is not None else os.environ.get(ENV_NICE, str(DEFAULT_NICE))
    try:
        nice = int(value)
    except ValueError:
        nice = -1
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"the dashboard's niceness must be a whole number from 0 (off) to {MAX_NICE}, not {value!r}")
    return nice


def _thread_ids() -> list[int]:
    """Every thread of this process (Linux); elsewhere 0, which names the whole process."""
    try:
        return [int(task.name) for task in _TASKS.iterdir()]
    except OSError:
        return [0]


def yield_cpu(nice: int) -> int:
    """Raise every thread of this process to niceness `nice` where it is lower; returns the
    process's niceness now. A thread that ended meanwhile, or a refusal, is skipped: the dashboard
    runs as it is."""
    for thread_id in _thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, thread_id) < nice:
                os.setpriority(os.PRIO_PROCESS, thread_id, nice)
        except OSError:
            continue
    return os.getpriority(os.PRIO_PROCESS, 0)
