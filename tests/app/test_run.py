"""`kvscope run` end to end: a capture per workload with every event kind the run exercised,
clean leak checks at every idle point, pressure that forces retraction and eviction, and
bad traces and impossible configs as one clear line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app import RunSpec, run
from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.model import MODEL_PRESETS
from kvscope.telemetry.queries import Capture
from kvscope.workloads import WORKLOADS

# a roomy radix pool keeps every finished request's KV, so frees need pressure (tested below)
ALWAYS = {"arrive", "admit", "match", "alloc", "lock", "unlock", "finish", "leak_check"}


def record(tmp_path: Path, workload: str, **kwargs: object) -> Capture:
    spec = RunSpec(
        engine=EngineConfig(**kwargs.pop("engine", {})),  # type: ignore[arg-type]
        model=MODEL_PRESETS[str(kwargs.pop("model", "tiny"))],
        workload=workload,
        num_requests=int(kwargs.pop("num_requests", 24)),  # type: ignore[call-overload]
        capture=tmp_path / f"{workload}.db",
        **kwargs,
    )  # type: ignore[arg-type]
    with open(tmp_path / "summary.txt", "w") as out:
        run(spec, out=out)
    return Capture(tmp_path / f"{workload}.db")


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_each_workload_records_a_clean_capture(tmp_path: Path, workload: str) -> None:
    capture = record(tmp_path, workload)
    kinds = set(capture.event_counts(1).kind)
    assert kinds >= ALWAYS, f"missing event kinds: {ALWAYS - kinds}"
    if workload != "random":
        assert {"insert", "split"} <= kinds
    checks = capture.leak_checks(1)
    assert not checks.empty and checks.ok.all()
    assert set(checks.pool) == {"full", "req"}
    assert capture.runs().iloc[0].status == "finished"
    requests = capture.requests(1)
    assert len(requests) == 24 and (requests.status == "finished").all()
    assert not capture.usage(1).empty and capture.snapshot_steps(1)
    summary = (tmp_path / "summary.txt").read_text()
    assert "24 finished" in summary and "all passed" in summary


def test_paced_arrivals_leak_check_every_idle_point(tmp_path: Path) -> None:
    # Gaps of 250 ms between short requests (4 output tokens) on one torch thread: the engine goes
    # idle between arrivals even on a loaded machine (at 25/s with two threads CI saw only the last).
    capture = record(
        tmp_path,
        "multi-turn",
        pace_per_s=4.0,
        num_requests=8,
        engine={"torch_threads": 1},
        workload_options={"output_len": 4},
    )
    checks = capture.leak_checks(1)
    assert checks.step.nunique() >= 3, "pacing should leave the engine idle several times"
    assert checks.ok.all()


def test_hybrid_swa_model_records_both_pools(tmp_path: Path) -> None:
    capture = record(
        tmp_path,
        "multi-tenant",
        model="tiny-swa",
        engine={"pool": PoolConfig(kv_size_tokens=600), "cache": CacheConfig(kind="swa-radix")},
    )
    checks = capture.leak_checks(1)
    assert set(checks.pool) == {"full", "swa", "req"} and checks.ok.all()
    events = capture.events(1, kinds=["alloc"], limit=100_000)
    assert set(events.pool) == {"full", "swa"}


def test_a_tiny_pool_forces_retraction_and_eviction_and_ends_clean(tmp_path: Path) -> None:
    engine = {
        "pool": PoolConfig(kv_size_tokens=200, max_running_requests=16),
        "scheduler": SchedulerConfig(chunked_prefill_size=32),
    }
    capture = record(tmp_path, "shared-prefix", engine=engine)
    kinds = set(capture.event_counts(1).kind)
    assert {"retract", "evict", "free"} <= kinds
    assert capture.leak_checks(1).ok.all()
    assert (capture.requests(1).status == "finished").all()


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "run", *args], capture_output=True, text=True, cwd=cwd, check=False
    )


BAD = [
    (["--trace", "bad.jsonl"], "bad.jsonl:2: field 'prompt': token id 99999 at index 1 is out of range"),
    (["--trace", "missing.jsonl"], "missing.jsonl: no such file"),
    (["--trace", "notjson.jsonl"], "notjson.jsonl:1: not valid JSON"),
    (["--workload", "random", "--kv-tokens", "16"], "smaller than one request"),
    (["--workload", "random", "--page-size", "3"], "page size must be a power of two, got 3"),
    (
        ["--workload", "random", "--model", "tiny-swa", "--max-context-len", "32"],
        "sliding window 32 is not smaller than the context length 32",
    ),
    (["--workload", "random", "--cache", "swa-radix"], "needs a hybrid sliding-window model"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[b[1][:30] for b in BAD])
def test_bad_input_is_one_clear_line_and_no_capture(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "bad.jsonl").write_text(
        '{"id": 1, "prompt": [5, 6, 7], "output_len": 2}\n{"id": 2, "prompt": [5, 99999], "output_len": 2}\n'
    )
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    out = cli(*args, "--capture", "c.db", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "c.db").exists()


def test_the_cli_prints_a_summary_and_writes_the_default_capture(tmp_path: Path) -> None:
    out = cli("--workload", "few-shot", "--num-requests", "8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    captures = list((tmp_path / "runs").glob("*-few-shot.db"))
    assert len(captures) == 1 and str(captures[0].relative_to(tmp_path)) in out.stdout
    for line in ("requests", "cached tokens", "hit rate", "evicted tokens", "retractions", "leak checks", "wall time"):
        assert line in out.stdout
