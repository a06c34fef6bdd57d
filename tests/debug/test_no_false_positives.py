"""No false positives: clean runs of every workload — chunked prefill, retraction, aborts,
the SWA model, the hiradix host tier under each write policy — pass `kvscope check`, and the
live debug monitor flags nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app import to_engine_requests
from kvscope.cache import MonitorConfig
from kvscope.debug.monitor import DebugMonitor
from kvscope.debug.report import build_report
from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import model_config
from kvscope.telemetry import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.workloads import WORKLOADS, generate

SETUPS = {  # name: (model, cache, page size, KV tokens, chunk)
    "radix": ("tiny", "radix", 1, 4096, 64),
    "radix-paged-tight": ("tiny", "radix", 4, 700, 32),  # evicts and retracts
    "chunk": ("tiny", "chunk", 1, 1500, 32),
    "swa-radix": ("tiny-swa,window=8", "swa-radix", 1, 1500, 32),
    "swa-chunk-paged": ("tiny-swa,window=8", "chunk", 4, 1500, 32),
    "scoped-radix": ("tiny", "scoped-radix", 1, 4096, 64),
    "scoped-radix-paged-tight": ("tiny", "scoped-radix", 4, 700, 32),  # private copies evict and retract
    "scoped-radix-demoting": ("tiny", "scoped-radix", 1, 4096, 64),  # the monitor tombstones public nodes
    # tight device and host pools: device leaves go to the host, host copies are evicted, loads come back
    "hiradix-write-through": ("tiny", "hiradix", 1, 400, 32),
    "hiradix-write-through-selective-paged": ("tiny", "hiradix", 4, 400, 32),
    "hiradix-write-back": ("tiny", "hiradix", 1, 400, 32),
}
HOST_TOKENS = 300
WRITE_POLICY = {
    "hiradix-write-through": "write_through",
    "hiradix-write-through-selective-paged": "write_through_selective",
    "hiradix-write-back": "write_back",
}
# NOTE: scoped setups promote quickly (k = 2, an epoch every 2 engine steps: the cache's clock is the
# step counter, so runs are deterministic), so public nodes, private copies and, with the monitor,
# tombstones under locks all occur within a short run
SCOPED = {"promote_k": 2, "epoch_s": 2.0}
TRIGGER_HAPPY = MonitorConfig(alpha=1.0, min_hits=2, min_new_users=2, min_user_ratio=0.0)


def run_clean(tmp_path: Path, workload: str, setup: str, abort_every: int | None = None) -> tuple[Path, Engine]:
    model, cache, page_size, kv_tokens, chunk = SETUPS[setup]
    extra: dict[str, object] = dict(SCOPED) if cache == "scoped-radix" else {}
    if cache == "hiradix":
        extra = {"write_policy": WRITE_POLICY[setup], "host_tokens": HOST_TOKENS}
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=kv_tokens, page_size=page_size, max_running_requests=16),
        cache=CacheConfig(kind=cache, **extra),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(chunked_prefill_size=chunk, swa_eviction_interval=4),
    )
    path = tmp_path / f"{workload}-{setup}.db"
    recorder = SQLRecorder(path, level="full")
    monitor = DebugMonitor(recorder)
    engine = Engine(config, model_config(model), monitor, read_checker=monitor)
    if cache == "scoped-radix":
        engine.memory.cache.set_clock(lambda: float(engine.scheduler.step))  # type: ignore[attr-defined]
    if setup == "scoped-radix-demoting":
        engine.memory.cache.monitor = TRIGGER_HAPPY  # type: ignore[attr-defined]
    requests = to_engine_requests(generate(workload, num_requests=20, seed=2))
    aborted: list[str] = []

    def maybe_abort(stats: object, submitted: int) -> None:
        step = engine.scheduler.step
        if abort_every and step % abort_every == 0 and len(aborted) < 3:
            live = [*engine.scheduler.running, *engine.scheduler.waiting]
            if live and engine.scheduler.abort_request(live[0].rid):
                aborted.append(live[0].rid)

    engine.run(requests, progress=maybe_abort)
    recorder.close()
    engine.check_integrity()
    monitor.ledger.check_integrity()
    assert not monitor.violations
    assert not monitor.ledger.is_broken(), monitor.ledger.orphans()
    if abort_every:
        assert aborted, "nothing was aborted; the test would prove little"
    return path, engine


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_clean_runs_are_clean(tmp_path: Path, workload: str, setup: str) -> None:
    path, engine = run_clean(tmp_path, workload, setup)
    report = build_report(path)
    assert report.clean, [leak.detail for leak in report.leaks] + report.first_failure
    assert report.onset_step is None, "the ledger's invariant series broke on a clean run"
    if setup in ("radix-paged-tight", "scoped-radix-paged-tight") and workload == "multi-turn":
        assert engine.stats.evicted_tokens > 0
    if setup in ("scoped-radix", "scoped-radix-demoting") and workload in ("multi-tenant", "shared-prefix"):
        scoped = engine.memory.cache.stats()  # type: ignore[attr-defined]
        assert scoped.promotions > 0, "nothing was promoted; the test would prove little"
        if setup == "scoped-radix-demoting" and workload == "multi-tenant":
            assert scoped.demotions > 0, "nothing was demoted; the test would prove little"
    if setup.startswith("hiradix") and workload == "multi-turn":
        counts = event_counts(path)
        for kind in ("write", "ack", "host_evict", "load"):
            assert counts.get(kind, 0) > 0, f"no {kind} event; the test would prove little ({counts})"


def event_counts(path: Path) -> dict[str, int]:
    capture = Capture(path)
    try:
        return {str(k): int(n) for k, n in capture.events(1, limit=1_000_000).kind.value_counts().items()}
    finally:
        capture.close()


@pytest.mark.parametrize(
    "setup", ["radix", "radix-paged-tight", "swa-radix", "chunk", "scoped-radix-demoting", "hiradix-write-back"]
)
def test_aborts_leave_a_clean_capture(tmp_path: Path, setup: str) -> None:
    path, _ = run_clean(tmp_path, "multi-turn", setup, abort_every=5)
    report = build_report(path)
    assert report.clean, [leak.detail for leak in report.leaks] + report.first_failure


def test_check_exit_codes(tmp_path: Path) -> None:
    path, _ = run_clean(tmp_path, "shared-prefix", "radix")
    ok = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", str(path)], capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0 and "clean" in ok.stdout, ok.stderr
    bad = tmp_path / "junk.db"
    bad.write_text("junk\n" * 50)
    broken = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", str(bad)], capture_output=True, text=True, check=False
    )
    assert broken.returncode == 2 and "not a kvscope capture" in broken.stderr
