"""The verdict of a run cut short (interrupted, crashed, still running) that the slot ledger found
leaks in: a leak whose free was due before the run's last step is a leak; one due in the last step
may be a free still pending there, and the inconclusive line says so, with how many."""

from __future__ import annotations

from kvscope.debug.report import Leak, LeakKind, LeakReport, render_text, verdict


def cut_short(*due_steps: int, status: str = "interrupted") -> LeakReport:
    leaks = [
        Leak(LeakKind.ORPHANED, "full", [10 * i, 10 * i + 1], rid=f"req-{i}", free_due_step=step)
        for i, step in enumerate(due_steps)
    ]
    return LeakReport("c.db", 1, "full", status, checks_run=2, last_step=50, leaks=leaks)


def test_a_free_due_before_the_last_step_is_a_leak_whatever_ended_the_run() -> None:
    for status in ("interrupted", "crashed", "running"):
        found = verdict(cut_short(50, 31, status=status))
        assert (found.verdict, found.exit_code) == ("leak", 1)
        assert found.reason == "leak: orphaned: 2 slots of pool full (req-1) and 1 more"


def test_frees_due_in_the_last_step_leave_it_inconclusive_and_say_why() -> None:
    found = verdict(cut_short(50, 50))
    assert (found.verdict, found.exit_code) == ("inconclusive", 3)
    assert found.reason == (
        "inconclusive: the run was interrupted at step 50; 2 idle leak checks balanced before it stopped; "
        "2 orphaned slot groups found where it stopped are not counted: each was due to be freed in the last "
        "step, whose frees may still have been pending"
    )
    assert "leaks: 2 root causes, 0 consequences (2 found where the run stopped" in render_text(cut_short(50, 50))


def test_a_finished_run_counts_every_leak_and_every_verdict_line_of_a_leak_says_leak() -> None:
    found = verdict(cut_short(50, status="finished"))
    assert found.verdict == "leak" and found.reason.startswith("leak: orphaned: ")
