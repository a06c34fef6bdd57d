"""The request stream a capacity replay reads: from a trace file, a workload, or a capture.

A replay needs each request's prompt and the tokens it leaves in the cache (prompt +
output). Where a request has no forced `output_ids` (the engine sampled them), the output
is `output_len` copies of the placeholder id -(i+1), i = the request's index: it occupies
cache like a real output but never matches another request's tokens.

A capture's `requests` table holds only lengths (no token ids), so a capture is replayed by
rebuilding its request stream from the run's config fingerprint (`runs.config`, key "workload"; its page size
from key "engine"): the trace
file it named (read again, relative to the current directory) or the generated workload
(`generate(name, num_requests, seed, vocab_size=model.vocab_size, **options)`), which is
deterministic for the same arguments. The engine itself inserts prompt + output[:-1] and
runs requests concurrently; a replay serves them one at a time and inserts prompt + output
(the protocol of benchmarks/bench_radix.py). A `kvscope serve` or `kvscope attach` capture names
no workload (its traffic came from clients), so it has no stream to rebuild.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvscope.telemetry.sqlite_files import read_head
from kvscope.workloads import TraceRequest, generate, read_trace

TOKEN_DTYPE = np.int32
ANY_VOCAB_SIZE = 2**31  # replays accept any int32 token id
SQLITE_MAGIC = b"SQLite format 3\x00"


class ReplaySource(NamedTuple):
    """A replay's request stream and where it came from."""

    requests: list[ReplayRequest]
    label: str  # the trace file, or "<capture> run <id>"
    run_id: int | None  # the captured run; None for a trace
    page_size: int | None  # the captured run's page size; None for a trace


class ReplayRequest(NamedTuple):
    rid: str
    prompt_ids: np.ndarray  # int32, non-empty
    all_ids: np.ndarray  # int32, prompt + output
    user: str | None = None  # the principal of a scoped replay (the trace's `user`)
    arrival_s: float | None = None  # the trace's arrival time; None: not given

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.all_ids)


def replay_requests(trace: Sequence[TraceRequest]) -> list[ReplayRequest]:
    """Prompt and prompt + output of every request, in order (placeholders for sampled outputs)."""
    out = []
    for i, request in enumerate(trace):
        prompt = np.ascontiguousarray(request.prompt_ids, dtype=TOKEN_DTYPE)
        if request.output_ids is not None:
            output = np.asarray(request.output_ids, dtype=TOKEN_DTYPE)
        else:
            output = np.full(request.output_len, -(i + 1), dtype=TOKEN_DTYPE)
        out.append(
            ReplayRequest(request.rid, prompt, np.concatenate((prompt, output)), request.user, request.arrival_s)
        )
    return out


def trace_times_s(requests: Sequence[ReplayRequest]) -> np.ndarray:
    """The clock of a scoped replay at each request, in seconds: the arrival times when every
    request has one, made non-decreasing (a trace's order across lines is not checked, and
    epochs never run backwards); otherwise the request's index x 1 s."""
    if requests and all(r.arrival_s is not None for r in requests):
        return np.maximum.accumulate(np.array([r.arrival_s for r in requests], dtype=np.float64))
    return np.arange(len(requests), dtype=np.float64)


def is_capture(source: str | os.PathLike[str]) -> bool:
    """A SQLAlchemy URL, or a file that starts with SQLite's magic bytes."""
    name = os.fspath(source)
    if "://" in name:
        return True
    try:
        return read_head(Path(name), len(SQLITE_MAGIC)) == SQLITE_MAGIC  # NOTE: keeps this process's SQLite locks
    except OSError:
        return False


def load_source(source: str | os.PathLike[str], run_id: int | None = None) -> ReplaySource:
    """The requests of a JSONL trace, or of a capture's run (the latest when run_id is None),
    with the run's page size. Raises ValueError (TraceError is one) with one line on bad input."""
    name = os.fspath(source)
    if is_capture(source):
        chosen, config = capture_run_config(source, run_id)
        label = f"{name} run {chosen}"
        trace, page_size = workload_of_config(config, label), capture_page_size(config)
    elif run_id is not None:
        raise ValueError(f"{name}: --run applies to captures, and this is not one")
    else:
        chosen, label, trace, page_size = None, name, read_trace(source, vocab_size=ANY_VOCAB_SIZE), None
    requests = replay_requests(trace)
    if not requests:
        raise ValueError(f"{label}: no requests")
    return ReplaySource(requests, label, chosen, page_size)


def load_requests(source: str | os.PathLike[str], run_id: int | None = None) -> list[ReplayRequest]:
    return load_source(source, run_id).requests


def capture_page_size(config: dict[str, Any]) -> int | None:
    """The page size a captured run's engine used, when its config records one."""
    pool = ((config.get("engine") or {}).get("pool") or {}) if isinstance(config, dict) else {}
    page_size = pool.get("page_size") if isinstance(pool, dict) else None
    return page_size if type(page_size) is int and page_size >= 1 else None


def capture_run_config(target: str | os.PathLike[str], run_id: int | None = None) -> tuple[int, dict[str, Any]]:
    """(run id, config fingerprint) of a captured run, the latest when run_id is None."""
    from kvscope.telemetry import Capture

    capture = Capture(os.fspath(target))
    try:
        runs = capture.runs()
    finally:
        capture.close()
    if runs.empty:
        raise ValueError(f"{os.fspath(target)}: no runs recorded")
    chosen = runs[runs["id"] == run_id] if run_id is not None else runs.tail(1)
    if chosen.empty:
        raise ValueError(f"{os.fspath(target)}: no run {run_id} (runs: {', '.join(map(str, runs['id']))})")
    row = chosen.iloc[0]
    try:
        config = json.loads(row["config"] or "{}")
    except json.JSONDecodeError:
        raise ValueError(f"{os.fspath(target)} run {int(row['id'])}: its config is not valid JSON") from None
    return int(row["id"]), config if isinstance(config, dict) else {}


def workload_of_config(config: dict[str, Any], where: str) -> list[TraceRequest]:
    workload = config.get("workload") or {}
    vocab_size = int((config.get("model") or {}).get("vocab_size") or ANY_VOCAB_SIZE)
    if workload.get("trace"):
        path = Path(workload["trace"])
        if not path.exists():
            raise ValueError(f"{where}: its trace {path} is not found (paths are relative to where it ran)")
        return read_trace(path, vocab_size=vocab_size)
    if workload.get("name"):
        return generate(
            workload["name"],
            num_requests=int(workload["num_requests"]),
            seed=int(workload["seed"]),
            vocab_size=vocab_size,
            **(workload.get("options") or {}),
        )
    raise ValueError(f"{where}: {_no_stream_reason(config)}")


def _no_stream_reason(config: dict[str, Any]) -> str:
    """Why a run's request stream cannot be rebuilt, in a line that names what would be needed."""
    if "serve" in config:
        return (
            "a `kvscope serve` capture stores each request's lengths, not its token ids, and a hit-rate curve "
            "needs the tokens to tell which prompts share a prefix: replay the traffic's own trace "
            "(`kvscope replay TRACE.jsonl`) or a `kvscope run` capture of the same workload"
        )
    source = config.get("source")
    if isinstance(source, dict) and source.get("kind") == "attach":
        return (
            "an attached engine's capture holds its KV events and metrics, not its requests' token ids, "
            "which a hit-rate curve needs: replay the traffic's own trace (`kvscope replay TRACE.jsonl`)"
        )
    return "its config names neither a workload nor a trace"
