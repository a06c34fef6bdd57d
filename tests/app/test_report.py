"""The debugger's verbs on the committed samples and on captures written here: `check` exit
codes, `report leaks` naming the injected culprits (text and JSON), a summary-level capture
reported from what it has, and `diff`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app import RunSpec, run
from kvscope.debug.report import SUMMARY_NOTE, build_report
from kvscope.engine.config import EngineConfig, PoolConfig
from kvscope.engine.faults import FaultSpec
from kvscope.engine.model import MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = {"shared-prefix.db": 0, "hybrid-swa.db": 0, "leaky.db": 1}


def kvscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )


@pytest.mark.parametrize(("name", "code"), sorted(SAMPLES.items()))
def test_check_gives_the_right_exit_code_on_every_sample(name: str, code: int) -> None:
    out = kvscope("check", f"sample_runs/{name}")
    assert out.returncode == code, out.stdout + out.stderr
    assert out.stdout.count("\n") == 1


def test_reading_verbs_exit_0_on_what_they_find_and_only_check_gates() -> None:
    """docs/cli.md's one rule: `report leaks`, `report engine-log` and `diff` exit 0 once they have read and
    reported (a leak included; the finding is in what they print); `check` alone exits 1 on a leak."""
    leaky_log = ROOT / "tests" / "debug" / "data" / "engine_logs" / "sglang-0.5.3-issue11970.log"
    reads = {
        "report leaks": kvscope("report", "leaks", "sample_runs/leaky.db"),
        "report engine-log": kvscope("report", "engine-log", str(leaky_log)),
        "diff": kvscope("diff", "sample_runs/shared-prefix.db", "sample_runs/leaky.db"),
    }
    assert {verb: out.returncode for verb, out in reads.items()} == dict.fromkeys(reads, 0), reads
    assert "verdict: leak" in reads["report leaks"].stdout and "verdict: leak" in reads["report engine-log"].stdout
    assert kvscope("check", "sample_runs/leaky.db").returncode == 1


def test_the_leaking_sample_report_names_the_injected_culprits() -> None:
    out = kvscope("report", "leaks", "sample_runs/leaky.db", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    injected = {(i["kind"], i["rid"]) for i in report["injected"]}
    kinds = {"leak-tail": "orphaned", "lock-leak": "lock-never-released", "double-free": "double-free"}
    found = {(leak["kind"], leak["rid"]) for leak in report["leaks"]}
    roots = {leak["rid"] for leak in report["leaks"] if leak["consequence_of"] is None}
    # three fault kinds in one run can touch the same slots: some show up as consequences
    assert {(kinds[k], rid) for k, rid in injected} <= found
    assert roots <= {rid for _, rid in injected}, "a root cause that was never injected"
    text = kvscope("report", "leaks", "sample_runs/leaky.db").stdout
    for _, rid in injected:
        assert rid in text
    assert "onset: step" in text and "first failure at step" in text


def test_a_summary_capture_is_reported_from_what_it_has(tmp_path: Path) -> None:
    spec = RunSpec(
        engine=EngineConfig(pool=PoolConfig(page_size=4)),
        model=MODEL_PRESETS["tiny"],
        workload="multi-turn",
        num_requests=16,
        level="summary",
        capture=tmp_path / "s.db",
        faults=(FaultSpec.parse("leak-tail:0.5"),),
        fault_seed=3,
    )
    with open(tmp_path / "out.txt", "w") as out:
        run(spec, out=out)
    report = build_report(tmp_path / "s.db")
    assert report.note == SUMMARY_NOTE and not report.leaks
    assert report.first_failure_step is not None and report.onset_step == report.first_failure_step
    assert report.suspects, "the requests table should still point at suspects"
    text = kvscope("report", "leaks", str(tmp_path / "s.db")).stdout
    assert "level summary" in text and "suspect requests" in text
    assert kvscope("check", str(tmp_path / "s.db")).returncode == 1


def test_report_on_bad_input(tmp_path: Path) -> None:
    missing = kvscope("report", "leaks", str(tmp_path / "none.db"))
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    assert kvscope("report", "leaks", "sample_runs/leaky.db", "--run", "9").returncode == 2


def test_diff_puts_two_captures_side_by_side() -> None:
    out = kvscope("diff", "sample_runs/shared-prefix.db", "sample_runs/leaky.db")
    assert out.returncode == 0, out.stderr
    for row in (
        "peak used tokens (full)",
        "hit rate (token-weighted)",
        "evicted tokens",
        "retractions",
        "leak checks failed",
        "events: alloc",
    ):
        assert row in out.stdout
