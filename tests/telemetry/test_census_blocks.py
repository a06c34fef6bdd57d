"""Every block a census names is stored (census_blocks, schema version 8), not only the few its leak
check's one-line message names; `report leaks` (text and --json) lists them all; two censuses at the
same step (a live poll and the idle census) never stop recording on the leak checks' key, and a
failure is never replaced by a pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.probe.census import MAX_NAMED, TERMS, BlockView, census_blocks, census_checks, take_census
from kvscope.telemetry import Capture, CensusBlock, SQLRecorder
from kvscope.telemetry.remote import RemoteRecorder

ROOT = Path(__file__).resolve().parents[2]
PROBE_CONFIG = {"source": {"kind": "probe", "engine": "vllm", "version": "0.32.0"}}
NUM_LEAKED = MAX_NAMED + 3


def _leaky_census(step: int) -> tuple[list, list[CensusBlock]]:
    """11 blocks with a reference nobody accounts for, each taken by its own request; block 40 freed
    once too often."""
    refs = {b: 1 for b in range(1, NUM_LEAKED + 1)} | {40: 0, 41: 0}
    takers = {b: (f"req-{b}", step - 1, "alloc") for b in range(1, NUM_LEAKED + 1)}
    result = take_census(BlockView(refs, set(), [41], 1), [{"live": [_Block(40)]}], [], {"live"}, takers)
    result = result._replace(releasers={40: ("req-x", step - 2, "free")})
    return census_checks(step, result), census_blocks(step, result)


class _Block:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.is_null = block_id, False


def _kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )


def test_every_named_block_is_stored_and_reported_not_only_the_messages_eight(tmp_path: Path) -> None:
    target = tmp_path / "blocks.db"
    rec = RemoteRecorder(target, level="summary", config=PROBE_CONFIG)
    rec.step = 5
    checks, blocks = _leaky_census(5)
    for check in checks:
        rec.leak_check(check)
    rec.census_blocks(blocks)
    rec.close()
    db = Capture(target)
    try:
        stored = db.census_blocks(1)
        message = db.leak_checks(1).set_index("pool").message["leaked"]
    finally:
        db.close()
    assert f"(+{NUM_LEAKED - MAX_NAMED} more)" in message  # NOTE: the one-line message stays short
    leaked = stored[stored.term == "leaked"]
    assert list(leaked.block) == list(range(1, NUM_LEAKED + 1))
    assert list(leaked.taker_rid) == [f"req-{b}" for b in range(1, NUM_LEAKED + 1)]
    assert (leaked.ref == 1).all() and (leaked.accounted == 0).all()
    lost = stored[stored.term == "lostref"].iloc[0]
    assert (lost.block, lost.ref, lost.accounted, lost.releaser_rid, lost.releaser_step) == (40, 0, 1, "req-x", 3)
    assert list(stored[stored.term == "unqueued"].block) == [40]

    text = _kvscope("report", "leaks", str(target)).stdout
    for b in range(1, NUM_LEAKED + 1):
        assert f"leaked: block {b} ref 1, accounted 0; last taken for request req-{b} (alloc at step 4)" in text, text
    assert "lostref: block 40 ref 0, accounted 1; last released for request req-x (free at step 3)" in text
    report = json.loads(_kvscope("report", "leaks", "--json", str(target)).stdout)
    named = [b for b in report["census_blocks"] if b["term"] == "leaked"]
    assert [b["block"] for b in named] == list(range(1, NUM_LEAKED + 1))
    assert named[-1]["taker"] == {"rid": f"req-{NUM_LEAKED}", "step": 4, "event": "alloc"}
    assert _kvscope("check", str(target)).returncode == 1


def test_a_second_census_at_the_same_step_never_stops_recording_nor_hides_a_failure(tmp_path: Path) -> None:
    """A live poll that fails and the idle census at the same step: the leak checks' key (run, step,
    pool) repeats. The failing rows stay whichever came first; the census blocks are kept once."""
    _two_censuses_at_one_step(str(tmp_path / "twice.db"))


@pytest.mark.postgres
def test_a_second_census_at_the_same_step_on_postgresql(postgres_url: str) -> None:
    """The same on a server database (ON CONFLICT in PostgreSQL's dialect)."""
    pytest.importorskip("psycopg", reason="the PostgreSQL driver (pip install 'kvscope[postgres]')")
    _two_censuses_at_one_step(postgres_url)


def _two_censuses_at_one_step(target: str) -> None:
    rec = SQLRecorder(target, level="summary", config=PROBE_CONFIG)
    clean = census_checks(7, take_census(BlockView({1: 0}, set(), [1], 1), [], [], set(), {}))
    leaky, blocks = _leaky_census(7)
    for checks in (clean, leaky, clean):  # NOTE: a pass, then a failure, then a pass, all at step 7
        for check in checks:
            rec.leak_check(check)
        rec.census_blocks(blocks)
        rec.flush()  # NOTE: each in its own transaction, as censuses handed off one by one are
    leaky8, _ = _leaky_census(8)
    for check in (*leaky8, *[c._replace(step=8) for c in clean]):  # NOTE: a failure, then a pass, in one batch
        rec.leak_check(check)
    rec.close()
    assert rec.failure is None
    db = Capture(target)
    try:
        checks = db.leak_checks(rec.run_id)
        stored = db.census_blocks(rec.run_id)
        status = db.runs().iloc[-1].status
    finally:
        db.close()
    assert status == "finished"
    for step in (7, 8):
        at = checks[checks.step == step].set_index("pool")
        assert len(at) == len(TERMS) and not bool(at.ok["leaked"]) and not bool(at.ok["lostref"]), at
    assert len(stored[stored.step == 7]) == len(blocks)
