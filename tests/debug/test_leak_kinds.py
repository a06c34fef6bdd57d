"""Leak kinds are one Enum: every leak a report names is a LeakKind, a stored report reads its
kinds back as members, and a kind nobody declared is refused rather than carried as a string."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.debug import Leak, LeakKind, LeakReport, build_report

ROOT = Path(__file__).resolve().parents[2]


def test_a_report_names_its_leaks_by_kind_and_reads_them_back() -> None:
    report = build_report(ROOT / "sample_runs" / "leaky.db")
    assert report.leaks, "the leaky sample should leak; the test would prove little"
    kinds = [leak.kind for leak in report.leaks]
    assert all(type(kind) is LeakKind for kind in kinds)
    again = LeakReport.from_json(report.to_json())
    assert all(type(leak.kind) is LeakKind for leak in again.leaks) and [leak.kind for leak in again.leaks] == kinds
    assert [leak["kind"] for leak in json.loads(report.to_json())["leaks"]] == [k.value for k in kinds]


def test_an_undeclared_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="orphan"):
        Leak("orphan", "full", [3])  # type: ignore[arg-type]
