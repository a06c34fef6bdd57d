"""benchmarks/RESULTS.md is one current table per benchmark script, and its helper merges rows."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path.stem for path in BENCH_DIR.glob("bench_*.py"))


def load_results() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmarks_results", BENCH_DIR / "_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


results = load_results()
RUN_A = results.Run("2026-12-06 10:00 UTC", "python benchmarks/bench_x.py", "a CPU; load average 1.00")
RUN_B = results.Run("2026-12-06 11:00 UTC", "python benchmarks/bench_x.py --more", "a CPU; load average 2.00")


def headings(text: str) -> list[str]:
    return [line[3:].strip() for line in text.splitlines() if line.startswith("## ")]


def test_results_md_has_exactly_one_section_per_bench_script() -> None:
    found = headings((BENCH_DIR / "RESULTS.md").read_text())
    assert sorted(found) == SCRIPTS, "RESULTS.md's ## sections and benchmarks/bench_*.py differ"


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_section_is_a_sentence_a_table_of_figures_and_their_runs(script: str) -> None:
    section = results.read_section((BENCH_DIR / "RESULTS.md").read_text(), script)
    assert section is not None, f"no ## {script} section"
    assert section.rows, f"## {script}: the table has no figure"
    for figure, run_line in section.rows:
        assert figure.met in results.VERDICTS
        date, command, machine = run_line.split(" · ")
        assert date[:4].isdigit() and command.startswith("`") and machine, f"## {script}: run line {run_line!r}"


def test_a_bad_section_is_refused_with_its_name() -> None:
    text = results.HEADER + "\n## bench_x\n\nWhat it measures.\n\n| figure | value |\n|---|---|\n| a | 1 |\n"
    with pytest.raises(ValueError, match="bench_x"):
        results.read_section(text, "bench_x")


def test_rewriting_replaces_its_rows_keeps_the_others_and_drops_unused_runs(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    first = [results.Figure("speed", "1.0 µs", "≤ 1 µs", "met"), results.Figure("rate", "5 events/s")]
    results.write_figures("bench_x", "What bench_x measures.", first, RUN_A, path)
    results.write_figures("bench_y", "What bench_y measures.", [results.Figure("size", "3 MiB")], RUN_A, path)
    results.write_figures("bench_x", "", [results.Figure("speed", "1.5 µs", "≤ 1 µs", "not met")], RUN_B, path)

    text = path.read_text()
    assert text.startswith(results.HEADER) and headings(text) == ["bench_x", "bench_y"]
    section = results.read_section(text, "bench_x")
    assert section.about == "What bench_x measures."
    assert section.rows == [
        (results.Figure("speed", "1.5 µs", "≤ 1 µs", "not met"), RUN_B.line()),
        (results.Figure("rate", "5 events/s"), RUN_A.line()),
    ]
    assert "| speed | 1.5 µs | ≤ 1 µs | not met | 2026-12-06 11:00 UTC | 1 |" in text
    assert "| rate | 5 events/s |  | no target | 2026-12-06 10:00 UTC | 2 |" in text

    results.write_figures("bench_x", "", [results.Figure("rate", "6 events/s")], RUN_B, path)
    section = results.read_section(path.read_text(), "bench_x")
    assert {line for _, line in section.rows} == {RUN_B.line()}
    assert RUN_A.line() not in results.section_bodies(path.read_text())["bench_x"]
    assert results.read_section(path.read_text(), "bench_y").rows == [(results.Figure("size", "3 MiB"), RUN_A.line())]


def test_a_cell_with_a_pipe_reads_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "RESULTS.md"
    figure = results.Figure("a | b", "x|y")
    results.write_figures("bench_x", "What it measures.", [figure], RUN_A, path)
    assert results.read_section(path.read_text(), "bench_x").rows == [(figure, RUN_A.line())]


@pytest.mark.parametrize(
    ("target", "met"),
    [("≤ 1 µs", "no target"), ("", "met"), ("≤ 1 µs", "fine")],
    ids=["no verdict", "no target", "bad verdict"],
)
def test_a_figure_needs_a_verdict_exactly_when_it_has_a_target(target: str, met: str) -> None:
    with pytest.raises(ValueError, match="speed"):
        results.Figure("speed", "1 µs", target, met)


def test_a_new_section_needs_its_sentence(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bench_x"):
        results.write_figures("bench_x", "", [results.Figure("rate", "1/s")], RUN_A, tmp_path / "RESULTS.md")


def test_the_command_line_adds_reported_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "RESULTS.md"
    common = ["--date", "2026-12-06 15:10 UTC", "--command", "CMD", "--machine", "2 cores, load 3", "--file", str(path)]
    results.main(["bench_probe", "--about", "The probe's cost.", *common, "--row", "full", "0.9 µs", "≤ 1 µs", "met"])
    rows = results.read_section(path.read_text(), "bench_probe").rows
    run_line = "2026-12-06 15:10 UTC · `CMD` · 2 cores, load 3"
    assert rows == [(results.Figure("full", "0.9 µs", "≤ 1 µs", "met"), run_line)]

    with pytest.raises(SystemExit) as exit_info:
        results.main(["bench_nothing", *common, "--row", "a", "1", "-", "no target"])
    assert exit_info.value.code == 2 and "bench_nothing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        results.main(["bench_probe", *common, "--row", "a", "1", "≤ 2", "no target"])
    assert "a target needs a verdict" in capsys.readouterr().err


def test_links_to_results_md_sections_name_a_section() -> None:
    root = BENCH_DIR.parent
    sections = set(headings((BENCH_DIR / "RESULTS.md").read_text()))
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    links = [(page.name, anchor) for page in pages for anchor in re.findall(r"RESULTS\.md#([\w-]+)", page.read_text())]
    assert links, "README.md's benchmark table links no RESULTS.md section"
    assert [link for link in links if link[1] not in sections] == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_writes_its_own_section(script: str) -> None:
    source = (BENCH_DIR / f"{script}.py").read_text()
    assert f'write_figures("{script}"' in source, f"{script}.py does not write its rows to ## {script}"


def test_the_median_interval_covers_as_the_binomial_law_says() -> None:
    """The interval's coverage is checked against a simulation: samples of a known median, the share
    of intervals that hold it."""
    import random

    rng = random.Random(3)
    for n in (8, 12, 16):
        held = 0
        for _ in range(4000):
            values = [rng.lognormvariate(0, 0.3) for _ in range(n)]  # NOTE: median exactly 1
            low, high, _ = results.median_interval(values)
            held += low <= 1.0 <= high
        _, _, cover = results.median_interval(list(range(n)))
        assert cover >= 0.95
        assert abs(held / 4000 - cover) < 0.02, (n, held / 4000, cover)


def test_a_cost_is_settled_only_when_its_whole_interval_is_on_one_side_of_the_target() -> None:
    tight = [0.99, 1.0, 1.01, 0.995, 1.005, 0.99, 1.0, 1.01, 1.02, 0.98, 1.0, 1.0]
    assert results.interval_verdict(tight, 0.02, cost_is_drop=True)[0] == "met"
    assert results.interval_verdict([0.9] * 12, 0.02, cost_is_drop=True)[0] == "not met"
    assert results.interval_verdict([1.1] * 12, 0.02, cost_is_drop=False)[0] == "not met"
    assert results.interval_verdict([0.5, 1.5] * 6, 0.02, cost_is_drop=True)[0] == "unclear"
    verdict, words = results.interval_verdict([1.0] * 4, 0.02, cost_is_drop=True)
    assert verdict == "unclear" and "too few pairs" in words  # NOTE: 4 values cover at most 87.5%


def test_a_bench_killed_by_sigterm_leaves_through_its_finally(tmp_path: Path) -> None:
    """What a bench started (a server) is stopped in its `finally` / `with` exit when `kill` or
    `timeout` ends it: Python's default SIGTERM skips them."""
    import subprocess
    import time

    stopped = tmp_path / "stopped"
    script = (
        f"import sys; sys.path.insert(0, {str(BENCH_DIR)!r}); import _results, time\n"
        "_results.stop_cleanly_on_sigterm()\n"
        "try:\n    print('up', flush=True); time.sleep(60)\n"
        f"finally:\n    open({str(stopped)!r}, 'w').write('stopped')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    started = time.monotonic()
    proc.terminate()
    assert proc.wait(timeout=30) == 143
    assert time.monotonic() - started < 30
    assert stopped.read_text() == "stopped"
