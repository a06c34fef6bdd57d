"""`kvscope report engine-log` on the log of an SGLang server that ran under `kvscope instrument`:
the probe printed its failed page census (with the capture and run) into the same log before
SGLang's own message, so the report points to the capture's culprits instead of "cannot tell"."""

from __future__ import annotations

from pathlib import Path

from kvscope.debug.engine_log import render_text, scan

PROBE_LINE = (
    "kvscope probe: page census (SGLang's leak check failed) at step 10, capture {capture} run 1: [full] "
    "1 page leaked (in no free list, tree or live row): page 7 (slots 28-31) last taken by request req-C "
    "(decode at step 9)"
)
SGLANG = [
    "[2026-11-26 10:00:00 TP0] Scheduler hit an exception: Traceback (most recent call last):",
    "ValueError: pool memory leak detected! [full] total=64, available=24, evictable=24, protected=0, "
    "session_held=0, uncached=12",
]


def test_a_leak_message_points_to_the_probes_capture_and_its_culprits(tmp_path: Path) -> None:
    capture = tmp_path / "run.db"
    capture.write_bytes(b"")  # NOTE: only its existence is looked at (the report stays pure Python)
    report = scan([PROBE_LINE.format(capture=capture), *SGLANG])
    assert [(p.line, p.step, p.capture, p.run_id) for p in report.probe] == [(1, 10, str(capture), 1)]
    text = render_text(report)
    assert (
        "kvscope's probe (line 1, step 10): [full] 1 page leaked (in no free list, tree or live row): page 7 "
        "(slots 28-31) last taken by request req-C (decode at step 9)"
    ) in text
    assert f"culprits: kvscope report leaks {capture} --run 1" in text
    assert "cannot tell" not in text and "to find out" not in text
    assert report.to_dict()["probe"][0]["command"] == f"kvscope report leaks {capture} --run 1"


def test_a_capture_not_on_this_machine_is_said_so(tmp_path: Path) -> None:
    gone = tmp_path / "elsewhere.db"
    text = render_text(scan([*SGLANG, PROBE_LINE.format(capture=gone)]))
    assert f"culprits: kvscope report leaks {gone} --run 1 (the capture is not on this machine)" in text


def test_a_census_sglangs_identity_passed_is_a_leak_of_its_own(tmp_path: Path) -> None:
    """The cancelling leak + double free: SGLang printed nothing, the probe's line is the only leak."""
    capture = tmp_path / "run.db"
    capture.write_bytes(b"")
    report = scan(["[2026-11-26 10:00:00 TP0] Prefill batch. #new-seq: 1", PROBE_LINE.format(capture=capture)])
    text = render_text(report)
    assert "kvscope's probe: 1 failed page census(es) SGLang's own check did not report" in text
    assert text.endswith("verdict: leak") and report.to_dict()["verdict"] == "leak"


def test_a_log_without_the_probe_reads_as_before() -> None:
    text = render_text(scan(SGLANG))
    assert "cannot tell:" in text and "kvscope's probe" not in text
