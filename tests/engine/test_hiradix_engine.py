"""`--cache hiradix` on the engine: with a device pool too small for the working set, nodes are
demoted to the host and loaded back at admission, and every logits row still equals the run
with caching disabled (and the dense forward); every workload runs clean under every write
policy, the host pool included in the idle leak check; `kvscope run` takes the host options
for --cache hiradix only."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvscope.app.runner import to_engine_requests
from kvscope.cache.hiradix import HiRadixCache
from kvscope.engine.config import WRITE_POLICIES, CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.memory import HiMemorySystem
from kvscope.engine.model import MODEL_PRESETS
from kvscope.engine.request import Req
from kvscope.workloads import WORKLOADS, TraceRequest, generate

Key = tuple[str, int]  # (rid, position whose next token the logits predict)
MODEL = MODEL_PRESETS["tiny"]
WAVE = 8  # requests per engine.run: later waves find earlier conversations demoted to the host


def make_engine(
    kind: str,
    kv_tokens: int,
    policy: str = "write_through",
    page_size: int = 1,
    seen: dict[Key, torch.Tensor] | None = None,
) -> Engine:
    def keep(req: Req, position: int, logits: torch.Tensor) -> None:
        if seen is not None:
            seen[(req.rid, position)] = logits.detach().clone()

    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=kv_tokens, page_size=page_size, max_running_requests=8, max_context_len=2048),
        cache=CacheConfig(kind=kind, write_policy=policy),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(chunked_prefill_size=64),
        device="cpu",
        strict=True,
    )
    return Engine(config, MODEL, on_logits=keep)


def run_waves(engine: Engine, trace: list[TraceRequest]) -> None:
    """The trace in waves, each run to its idle point: every idle leak check (host pool
    included) balances and both tiers conserve."""
    reqs = to_engine_requests(trace)
    for start in range(0, len(reqs), WAVE):
        stats = engine.run(reqs[start : start + WAVE])
        engine.check_integrity()
        checks = engine.memory.leak_checks(engine.scheduler.step, [])
        assert all(c.ok for c in checks), [c.message() for c in checks if not c.ok]
        assert stats.leak_checks_failed == 0
    assert engine.stats.num_finished == len(reqs)


def dense_logits(engine: Engine, trace: list[TraceRequest]) -> dict[Key, torch.Tensor]:
    out = {}
    for t in trace:
        ids = np.concatenate((t.prompt_ids, t.output_ids[:-1])).astype(np.int64)
        logits = engine.model.dense_forward(torch.from_numpy(ids))
        for position in range(len(ids)):
            out[(t.rid, position)] = logits[position]
    return out


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_logits_after_demotion_and_load_back_equal_the_uncached_run(policy: str, page_size: int) -> None:
    trace = generate("multi-turn", num_requests=48, seed=0, vocab_size=MODEL.vocab_size)
    hi: dict[Key, torch.Tensor] = {}
    engine = make_engine("hiradix", 640, policy, page_size, hi)
    run_waves(engine, trace)
    cache = engine.memory.cache
    assert isinstance(cache, HiRadixCache)
    assert cache.num_load_back_tokens > 0 and engine.stats.evicted_tokens > 0  # both tiers were used
    assert cache.host_tokens() > 0
    uncached: dict[Key, torch.Tensor] = {}
    run_waves(make_engine("none", 640, page_size=page_size, seen=uncached), trace)
    dense = dense_logits(engine, trace)
    common = hi.keys() & uncached.keys()
    decode = {(t.rid, p) for t in trace for p in range(len(t.prompt_ids), len(t.prompt_ids) + t.output_len - 1)}
    assert decode <= common  # NOTE: prefill rows differ in where chunks end; every decode row is in both
    for key in common:
        torch.testing.assert_close(hi[key], uncached[key], atol=2e-5, rtol=1e-4, msg=f"logits differ at {key}")
    for key, row in hi.items():
        torch.testing.assert_close(row, dense[key], atol=2e-5, rtol=1e-4, msg=f"logits differ from dense at {key}")


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_every_workload_runs_clean_under_every_write_policy(workload: str, policy: str) -> None:
    trace = generate(workload, num_requests=24, seed=1, vocab_size=MODEL.vocab_size)
    longest = max(len(t.prompt_ids) + t.output_len for t in trace)
    engine = make_engine("hiradix", max(640, 2 * longest), policy)
    run_waves(engine, trace)
    memory = engine.memory
    assert isinstance(memory, HiMemorySystem)
    host = [c for c in memory.leak_checks(engine.scheduler.step, []) if c.pool == "host"]
    assert len(host) == 1 and host[0].ok and host[0].evictable == memory.cache.host_tokens()
    assert memory.cache.num_in_flight() == 0 and memory.cache.protected_size() == 0


def test_the_other_caches_report_no_host_pool() -> None:
    engine = make_engine("radix", 640)
    assert [c.pool for c in engine.memory.leak_checks(0, [])] == ["full", "req"]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "run", *args], capture_output=True, text=True, cwd=cwd, check=False
    )


def test_kvscope_run_with_hiradix_exits_clean(tmp_path: Path) -> None:
    out = cli(
        "--workload",
        "multi-turn",
        "--cache",
        "hiradix",
        "--num-requests",
        "48",
        "--kv-tokens",
        "622",
        "--write-policy",
        "write_back",
        "--host-ratio",
        "1.5",
        "--capture",
        "c.db",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "leak checks       1 (all passed)" in out.stdout and "leak report       clean" in out.stdout
    host = re.search(
        r"host tier +(\d+) tokens: (\d+) written, (\d+) loaded back, (\d+) cached tokens came from the "
        r"host \(([\d.]+)% of cached tokens\), (\d+) dropped",
        out.stdout,
    )
    assert host is not None, out.stdout
    size, written, loaded, from_host, _, _ = (float(g) for g in host.groups())
    assert size == 934 and written > 0 and 0 < from_host <= loaded  # 622 x 1.5 = 933, whole pages plus one
    with sqlite3.connect(tmp_path / "c.db") as conn:  # the summary's totals are the capture's last usage row
        row = conn.execute(
            "SELECT cum_written_tokens, cum_loaded_tokens, cum_host_hit_tokens FROM usage ORDER BY step DESC LIMIT 1"
        ).fetchone()
    assert row == (written, loaded, from_host)


def test_a_single_tier_run_prints_no_host_line(tmp_path: Path) -> None:
    out = cli("--workload", "multi-turn", "--num-requests", "8", "--level", "off", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "host tier" not in out.stdout and "leak checks" in out.stdout


BAD = [
    (["--write-policy", "write_back"], "--write-policy applies to --cache hiradix only, not radix"),
    (
        ["--cache", "chunk", "--host-ratio", "3", "--host-tokens", "512"],
        "--host-ratio, --host-tokens apply to --cache hiradix only, not chunk",
    ),
    (["--cache", "hiradix", "--model", "tiny-swa"], "the hiradix cache is for full-attention models"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[b[1][:30] for b in BAD])
def test_host_options_without_hiradix_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    out = cli("--workload", "random", *args, "--capture", "c.db", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "c.db").exists()
