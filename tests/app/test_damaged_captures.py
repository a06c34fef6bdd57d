"""Issue 40, point 18: one rule for every reading verb. A damaged capture (tests/damage_corpus.py) is one
line naming it damaged and exit 2 from check, report leaks, runs, diff and fleet: never a traceback, never
a verdict read from what is left. The checks at open that find it are cheap on any size (the header's
length, the tables, each table's columns, the schema version); a verdict also has SQLite check every page
of a file too big to check at open."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app.cli import main
from kvscope.telemetry import store
from tests.damage_corpus import SOURCE, corpus, not_captures

VERBS = (("check",), ("report", "leaks"), ("runs",), ("diff",), ("fleet",))
VERDICT_VERBS = (("check",), ("report", "leaks"), ("diff",))
VERDICT_WORDS = ("clean", "leak", "inconclusive")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return corpus(tmp_path_factory.mktemp("damaged"))


def say(verb: tuple[str, ...], path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The verb's exit code and everything it printed (an exception escaping it fails the test)."""
    args = [*verb, str(path), *([str(SOURCE)] if verb == ("diff",) else [])]
    code = main(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def assert_one_damaged_line(code: int, said: str, path: Path, what: str = "damaged capture (") -> None:
    lines = said.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, said)
    assert f"{path}: {what}" in lines[0], said


def test_the_source_capture_reads_clean(capsys: pytest.CaptureFixture[str]) -> None:
    """The corpus's source gives verdict clean: what a damaged copy says is the damage's doing."""
    code, said = say(("check",), SOURCE, capsys)
    assert code == 0 and said.startswith(f"{SOURCE}: clean: "), said


def test_every_reading_verb_says_damaged_in_one_line_and_exits_2(
    damaged: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = []
    for name, path in damaged.items():
        for verb in VERBS:
            code, said = say(verb, path, capsys)
            if code != 2 or len(said.strip().splitlines()) != 1 or f"{path}: damaged capture (" not in said:
                wrong.append((name, " ".join(verb), code, said.strip()[-300:]))
    assert not wrong, "\n".join(map(str, wrong))


def test_a_large_capture_is_checked_cheaply_at_open_and_whole_before_a_verdict(
    damaged: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As if every file were above QUICK_CHECK_MAX_BYTES (no quick_check at open): a cut tail, a lost
    table or column and a bad schema version are still found at open by every verb; a damaged page in
    the middle is found before any verdict (check, report leaks, diff)."""
    monkeypatch.setattr(store, "QUICK_CHECK_MAX_BYTES", 0)
    wrong = []
    for name, path in damaged.items():
        for verb in VERDICT_VERBS if "page" in name else VERBS:
            code, said = say(verb, path, capsys)
            if code != 2 or len(said.strip().splitlines()) != 1 or f"{path}: damaged capture (" not in said:
                wrong.append((name, " ".join(verb), code, said.strip()[-300:]))
    assert not wrong, "\n".join(map(str, wrong))


def test_a_tail_cut_inside_the_last_page_is_named_with_its_sizes(
    damaged: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite opens such a file and reads what is left without an error: the header's page count is what
    tells."""
    path = damaged["tail-cut-1000B"]
    size = SOURCE.stat().st_size
    code, said = say(("check",), path, capsys)
    cut = f"damaged capture (truncated: {size - 1000} bytes, the header says {size})"
    assert_one_damaged_line(code, said, path, cut)


def test_a_dropped_column_is_named(damaged: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    path = damaged["no-column-requests.dispatch"]
    code, said = say(("check",), path, capsys)
    assert_one_damaged_line(code, said, path, "damaged capture (table requests lacks columns ['dispatch'])")


@pytest.mark.parametrize(("name", "says"), [("empty", "empty capture ("), ("text", "not a kvscope capture (")])
def test_a_file_that_is_no_capture_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, says: str
) -> None:
    path = not_captures(tmp_path)[name]
    for verb in VERBS:
        code, said = say(verb, path, capsys)
        assert_one_damaged_line(code, said, path, says)


@pytest.mark.parametrize("name", ["tail-cut-1000B", "no-column-requests.dispatch", "zeroed-page-runs"])
def test_the_command_ends_with_one_line_and_no_traceback(damaged: dict[str, Path], name: str) -> None:
    """The whole command, in its own process: stderr is the one line, the exit code 2."""
    for verb in VERBS:
        args = [*verb, str(damaged[name]), *([str(SOURCE)] if verb == ("diff",) else [])]
        out = subprocess.run([sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, check=False)
        assert out.returncode == 2 and not out.stdout, (verb, out)
        assert out.stderr.count("\n") == 1 and "damaged capture (" in out.stderr and "Traceback" not in out.stderr
