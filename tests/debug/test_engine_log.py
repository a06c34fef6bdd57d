"""`kvscope report engine-log`: SGLang's leak messages of every release family, found in server
logs and explained in the words of kvscope's own leak report.

The fixtures in data/engine_logs/ are built from the message formats of each release and, where
a real issue printed the numbers, from those numbers (sglang #6888, #11970, #19081, PR #16067).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from kvscope.debug.engine_log import EngineLogReport, read_engine_log, render_text, scan
from kvscope.telemetry import LeakCheck

DATA = Path(__file__).parent / "data" / "engine_logs"
ROOT = Path(__file__).parents[2]


def first(report: EngineLogReport, pool: str) -> str:
    """The words of `pool` in the report's first message ('' when it balances)."""
    return next(p for p in report.leaks[0].pools if p.pool == pool).words()


@pytest.mark.parametrize(
    ("name", "family", "pool", "words"),
    [
        ("sglang-0.4.6-issue6888.log", "0.4.6", "full", "4224 tokens counted twice"),
        ("sglang-0.4.6-warnings.log", "0.4.6", "full", "7 tokens missing"),
        ("sglang-0.5.3-issue11970.log", "0.4.10", "full", "59 tokens missing"),
        ("sglang-0.5.10-session.log", "0.5.6–0.5.10", "full", "488 tokens missing"),
        ("sglang-0.5.10-swa.log", "0.5.6–0.5.10", "swa", "21 tokens missing"),
        ("sglang-0.5.8-mamba-pr16067.log", "0.5.6–0.5.10", "mamba", "1 slots missing"),
        ("sglang-0.5.9-busy-issue19081.log", "0.5.6–0.5.10", "full", "64 tokens missing"),
        ("sglang-0.5.18-swa-crash.log", "0.5.14–0.5.23", "full", "288 tokens missing"),
        ("sglang-0.5.23-strict-off.log", "0.5.14–0.5.23", "full", "496 tokens missing"),
    ],
)
def test_each_release_family_gives_its_pools_deficit(name: str, family: str, pool: str, words: str) -> None:
    report = read_engine_log(DATA / name)
    assert report.leaks
    assert report.leaks[0].version_family == family
    assert first(report, pool) == words


def test_046_available_is_split_into_free_and_evictable_not_counted_twice() -> None:
    # 0.4.6 prints available_size = free + evictable, then both on lines of their own
    pool = read_engine_log(DATA / "sglang-0.4.6-issue6888.log").leaks[0].pools[0]
    assert (pool.total, pool.terms) == (3185200, {"available": 2864304, "evictable": 325120, "protected": 0})
    assert pool.missing == -4224


def test_pool_lines_read_exactly_like_kvscopes_own_leak_check() -> None:
    leak = read_engine_log(DATA / "sglang-0.5.18-swa-crash.log").leaks[0]
    for pool in leak.pools:
        own = LeakCheck(0, pool.pool, pool.total or 0, **pool.terms)
        assert pool.line() == own.message()
    assert [p.pool for p in leak.short_pools] == ["full"]  # the SWA pool balances


def test_idle_lock_is_named_in_kvscopes_words_when_the_pool_balances() -> None:
    log = [
        "ValueError: pool memory leak detected! [full] total=100, available=60, evictable=30, protected=10, "
        "session_held=0, uncached=0",
        "[swa] total=50, available=40, evictable=9, protected=0, session_held=0, uncached=0",
    ]
    pools = scan(log).leaks[0].pools
    assert pools[0].line() == LeakCheck(0, "full", 100, 60, 30, 10, 0, 0).message()
    assert pools[0].words() == "10 tokens still locked at an idle point"
    assert pools[1].words() == "1 tokens missing"


def test_crash_log_places_the_message_among_interleaved_lines() -> None:
    report = read_engine_log(DATA / "sglang-0.5.18-swa-crash.log")
    leak = report.leaks[0]
    assert (leak.line, leak.end_line) == (19, 20)  # the ValueError line and its [swa] line, not the INFO after
    assert (leak.timestamp, leak.rank, leak.timestamp_line) == ("2026-04-07 15:08:53", "TP0", 8)
    assert leak.raised_as == "ValueError" and leak.check == "idle"
    assert [line for line, _ in report.crash_lines] == [8, 23, 31, 32]
    assert report.leaks[1].repeat_of == 1 and report.leaks[1].rank == "TP1"
    text = render_text(report)
    assert "the same message again on line 28" in text
    assert "--model tiny-swa --page-size 1 --debug" in text and "kvscope report leaks" in text
    assert "which request leaked, which slots" in text


def test_swa_two_pool_message_keeps_each_pools_terms() -> None:
    pools = read_engine_log(DATA / "sglang-0.5.10-swa.log").leaks[0].pools
    assert [(p.pool, p.total, p.missing) for p in pools] == [("full", 200000, 0), ("swa", 40000, 21)]
    assert pools[1].terms == {"available": 30000, "evictable": 9979, "protected": 0, "held": 0}


def test_old_hybrid_swa_lines_fall_in_the_0410_family() -> None:
    log = [
        "[2025-08-01 12:00:00 TP0] Scheduler hit an exception: Traceback (most recent call last):",
        "ValueError: token_to_kv_pool_allocator memory leak detected! self.full_tokens_per_layer=1000, "
        "full_available_size=600, full_evictable_size=390, full_protected_size=0",
        "self.swa_tokens_per_layer=500, swa_available_size=400, swa_evictable_size=100, swa_protected_size=0",
        "",
    ]
    leak = scan(log).leaks[0]
    assert leak.version_family == "0.4.10"
    assert [(p.pool, p.words()) for p in leak.pools] == [("full", "10 tokens missing"), ("swa", "")]


def test_prefixes_on_every_line_and_each_kind_of_message() -> None:
    report = read_engine_log(DATA / "sglang-0.5.23-strict-off.log")
    kinds = [(leak.line, leak.kind, leak.raised_as) for leak in report.leaks]
    assert kinds == [
        (2, "pool-leak", "log"),
        (4, "req-pool-leak", "log"),
        (5, "use-after-free", "log"),
        (7, "pool-leak", "log"),
        (9, "pool-leak", "log"),
    ]
    pool_leak, req, uaf, again, pool_bytes = report.leaks
    assert [p.pool for p in pool_leak.pools] == ["full", "mamba"] and pool_leak.end_line == 3
    assert pool_leak.pools[1].leaked_pages == {"leaked_mamba_pages": "{33, 34}"}
    assert req.pools[0].words() == "1 rows missing"
    assert uaf.pages == {"owner_page_refs": 3, "sample_pages": "[17, 18, 40]"}
    assert again.repeat_of == 1 and pool_bytes.repeat_of is None
    assert pool_bytes.pools[0].words() == "34592 bytes missing"
    assert pool_leak.timestamp == "2026-10-30 08:00:02" and pool_leak.rank == "DP0 TP0"


def test_a_source_line_quoting_the_text_is_not_a_message() -> None:
    log = [
        "[2026-02-27 23:50:14 TP1] Scheduler hit an exception: Traceback (most recent call last):",
        '    ), f"Mem Leak Detected! {total_tokens=} vs {self.max_total_num_tokens=}"',
        "AssertionError: Mem Leak Detected! total_tokens=90 vs self.max_total_num_tokens=100",
    ]
    report = scan(log)
    assert [(leak.line, leak.pools[0].words()) for leak in report.leaks] == [(3, "10 tokens missing")]


def test_a_log_without_leak_messages_says_so() -> None:
    report = read_engine_log(DATA / "no-leak.log")
    assert report.leaks == [] and report.lines_read == 8
    assert "leak messages: none" in render_text(report)


def test_bad_utf8_around_a_message_is_tolerated(tmp_path: Path) -> None:
    log = tmp_path / "mixed.log"
    log.write_bytes(
        b"[2026-01-01 00:00:00 TP0] caf\xe9 \xff\xfe request text\n"
        b"ValueError: pool memory leak detected! [full] total=10, available=5, evictable=0, protected=0, "
        b"session_held=0, uncached=0\n\xc3\x28 more\n"
    )
    report = read_engine_log(log)
    assert [(leak.line, leak.pools[0].missing) for leak in report.leaks] == [(2, 5)]


def test_a_huge_log_is_streamed_not_read_whole(tmp_path: Path) -> None:
    log = tmp_path / "huge.log"
    filler = (
        "[2026-01-01 00:00:00 TP0] Decode batch, #running-req: 12, #token: 4096, token usage: 0.42, "
        "cuda graph: True, gen throughput (token/s): 1000.00, #queue-req: 0\n"
    )
    with log.open("w") as out:
        for _ in range(100_000):
            out.write(filler)
        out.write(
            "ValueError: pool memory leak detected! [full] total=100, available=90, evictable=0, "
            "protected=0, session_held=0, uncached=0\n"
        )
        for _ in range(100_000):
            out.write(filler)
    tracemalloc.start()
    try:
        report = read_engine_log(log)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.lines_read == 200_001
    assert [(leak.line, leak.pools[0].missing) for leak in report.leaks] == [(100_001, 10)]
    assert peak < log.stat().st_size // 10  # line by line: far below the file's ~29 MB


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "report", "engine-log", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("kind", "why"), [("missing", "no such file"), ("directory", "is a directory"), ("binary", "not a text log")]
)
def test_unreadable_input_is_one_line_and_exit_2(tmp_path: Path, kind: str, why: str) -> None:
    target = tmp_path / "server.log"
    if kind == "directory":
        target.mkdir()
    elif kind == "binary":
        target.write_bytes(bytes(range(256)) * 64)
    done = cli(str(target))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("kvscope report: error: ") and str(target) in done.stderr and why in done.stderr


def test_cli_exit_codes_and_json_shape() -> None:
    """A reading verb exits 0 once it has read and reported, a leak found or not (docs/cli.md: only
    `check` gates); the finding is the JSON's verdict."""
    clean = cli(str(DATA / "no-leak.log"), "--json")
    assert clean.returncode == 0
    assert json.loads(clean.stdout) == {
        "log": str(DATA / "no-leak.log"),
        "lines_read": 8,
        "page_size": 16,
        "messages": [],
        "crash_lines": [],
        "verdict": "none",
    }
    leaky = cli(str(DATA / "sglang-0.5.3-issue11970.log"), "--json")
    assert leaky.returncode == 0, leaky.stderr
    document = json.loads(leaky.stdout)
    assert document["verdict"] == "leak"
    message = document["messages"][0]
    assert {
        "index",
        "line",
        "end_line",
        "timestamp",
        "timestamp_line",
        "rank",
        "kind",
        "check",
        "version_family",
        "raised_as",
        "anchor",
        "pools",
        "pages",
        "notes",
        "text",
        "repeat_of",
        "cannot_tell",
        "next_step",
    } == set(message)
    assert (message["line"], message["timestamp"], message["version_family"]) == (14, "2025-10-22 09:15:11", "0.4.10")
    assert message["pools"] == [
        {
            "pool": "full",
            "total": 270331,
            "unit": "tokens",
            "idle": True,
            "missing": 59,
            "locked": 0,
            "terms": {"available": 644, "evictable": 269628, "protected": 0},
            "leaked_pages": {},
            "printed": {
                "self.max_total_num_tokens": "270331",
                "available_size": "644",
                "evictable_size": "269628",
                "protected_size": "0",
            },
            "words": "59 tokens missing",
        }
    ]
    text = cli(str(DATA / "sglang-0.5.3-issue11970.log"))
    assert (
        text.returncode == 0
        and "[full] total=270331, available=644, evictable=269628, protected=0: 59 tokens missing" in text.stdout
        and text.stdout.rstrip().endswith("verdict: leak")
    )


def test_the_verb_never_loads_torch() -> None:
    code = (
        "import sys; from kvscope.app.cli import main; "
        f"code = main(['report', 'engine-log', {str(DATA / 'sglang-0.5.10-swa.log')!r}]); "
        "print('torch loaded' if 'torch' in sys.modules else 'no torch', code)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "no torch 0"


def test_a_json_log_with_escaped_newlines_and_colour_codes_keeps_the_pools_apart() -> None:
    log = [
        '{"time": "2026-05-01T10:00:00Z", "level": "ERROR", "msg": "pool memory leak detected! [full] total=100, '
        "available=50, evictable=40, protected=0, session_held=0, uncached=0\\n[swa] total=30, available=20, "
        'evictable=10, protected=0, session_held=0, uncached=0"}',
        "\x1b[31m[2026-05-01 10:00:01 TP0] Full Pool Mem Leak Detected! [full] total=100, available=90, "
        "evictable=0, protected=0, session_held=0, uncached=8\x1b[0m",
    ]
    first_leak, busy = scan(log).leaks
    assert [(p.pool, p.missing) for p in first_leak.pools] == [("full", 10), ("swa", 0)]
    assert (busy.check, busy.timestamp, busy.pools[0].words()) == ("busy", "2026-05-01 10:00:01", "2 tokens missing")


def test_an_extra_term_of_a_modified_build_is_a_part_and_double_frees_are_found() -> None:
    log = [
        "ValueError: pool memory leak detected! [full] total=500000, available=419745, evictable=90, "
        "protected=0, session_held=0, uncached=0, withheld=80165",
        "[2026-06-01 09:00:00 TP2] KV double free: sub-pool 1 has 4 duplicate pages.",
    ]
    pool_leak, double = scan(log).leaks
    assert pool_leak.pools[0].terms["withheld"] == 80165 and pool_leak.pools[0].missing == 0
    assert (double.kind, double.pages, double.rank) == ("double-free", {"sub_pool": 1, "duplicate_pages": 4}, "TP2")


def test_the_01_warning_with_its_terms_on_the_line_before() -> None:
    # sglang #105: `UserWarning: Warning: available_size=35244, max_total_num_token=42308` + `KV cache pool leak…`
    log = [
        "[2024-01-26 15:23:01] /sglang/srt/managers/router/model_rpc.py:205: UserWarning: Warning: "
        "available_size=35244, max_total_num_token=42308",
        "KV cache pool leak detected!",
        "  warnings.warn(",
    ]
    leak = scan(log).leaks[0]
    assert (leak.line, leak.version_family, leak.raised_as, leak.timestamp_line) == (1, "0.1", "UserWarning", 1)
    assert leak.pools[0].line() == "[full] total=42308, available=35244: 7064 tokens missing"
