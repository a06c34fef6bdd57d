"""The scoped cache's options on the command line: the value parsers, the pinned-prefix file,
bad input as one line and exit 2, the flags refused without --cache scoped-radix, and a real
`kvscope run` on the scoped cache whose capture records them."""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app import build_parser, main
from kvscope.app.runner import engine_from_args
from kvscope.app.units import on_off, pinned_prefixes, promote_threshold, scoped_cache_options
from kvscope.engine import CacheConfig, EngineConfig
from kvscope.workloads import ByteTokenizer


def test_promote_threshold_takes_whole_numbers_and_inf() -> None:
    assert promote_threshold("3") == 3 and promote_threshold(" 1 ") == 1
    assert promote_threshold("inf") == math.inf and promote_threshold("INF") == math.inf
    for bad in ("0", "-1", "2.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            promote_threshold(bad)


def test_on_off() -> None:
    assert on_off("on") is True and on_off("OFF") is False
    with pytest.raises(argparse.ArgumentTypeError):
        on_off("maybe")


def test_pinned_file_reads_all_three_line_forms(tmp_path: Path) -> None:
    path = tmp_path / "pinned.jsonl"
    path.write_text('[5, 6, 7]\n\n{"prompt": [8, 9]}\n{"text": "hi"}\n')
    prefixes = pinned_prefixes(path)
    assert prefixes == ((5, 6, 7), (8, 9), tuple(int(i) for i in ByteTokenizer().encode("hi")))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": [1, "x"]}', "token ids must be a list of ints"),
        ("[]", "the prefix is empty"),
        ('{"text": 3}', "expected a list of token ids"),
        ("[1, 2", "not JSON"),
        ("[-1]", "token ids must be a list of ints"),
    ],
)
def test_a_bad_pinned_line_names_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "pinned.jsonl"
    path.write_text(f"[1, 2]\n{line}\n")
    with pytest.raises(ValueError, match=rf"pinned.jsonl line 2: .*{message}"):
        pinned_prefixes(path)
    path.write_text("[1, 2]\n[3]\n")  # NOTE: the positive control: the same file with a good line reads
    assert pinned_prefixes(path) == ((1, 2), (3,))


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and stderr of `kvscope ARGV` in this process (argparse errors exit, handlers return)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--workload", "multi-tenant", "--promote-k", "0"], "argument --promote-k: '0' is not a promotion"),
        (["run", "--workload", "multi-tenant", "--cache", "scoped-radix", "--epoch-s", "0"], "argument --epoch-s"),
        (["run", "--workload", "multi-tenant", "--cache", "scoped-radix", "--epoch-s", "inf"], "argument --epoch-s"),
        (["serve", "--cache", "scoped-radix", "--dedup", "maybe"], "argument --dedup: 'maybe' is not on or off"),
        (
            ["run", "--workload", "multi-tenant", "--cache", "scoped-radix", "--pinned", "/nonexistent/p.jsonl"],
            "argument --pinned: /nonexistent/p.jsonl: No such file",
        ),
        (["run", "--workload", "multi-tenant", "--promote-k", "3"], "--promote-k applies to --cache scoped-radix only"),
        (
            ["run", "--workload", "multi-tenant", "--cache", "radix", "--dedup", "off", "--merge-chains"],
            "--dedup, --merge-chains apply to --cache scoped-radix only, not radix",
        ),
        (["serve", "--epoch-s", "10"], "--epoch-s applies to --cache scoped-radix only, not radix"),
        (["replay", "trace.jsonl", "--promote-k", "inf"], "--promote-k applies to --cache scoped-radix only"),
        (
            ["run", "--workload", "multi-tenant", "--model", "tiny-swa", "--cache", "scoped-radix"],
            "not scoped-radix (the scoped cache is for full-attention models)",
        ),
    ],
)
def test_bad_scoped_input_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_main(argv, capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert "Traceback" not in err


def test_a_bad_pinned_file_through_the_cli_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "pinned.jsonl"
    path.write_text('[1]\n{"prompt": "abc"}\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "run",
            "--workload",
            "multi-tenant",
            "--cache",
            "scoped-radix",
            "--pinned",
            str(path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip() == f"kvscope run: error: argument --pinned: {path} line 2: token ids must be a "
        "list of ints in [0, 2^31)"
    )


def test_engine_options_reach_the_cache_config(tmp_path: Path) -> None:
    path = tmp_path / "pinned.jsonl"
    path.write_text('{"text": "system"}\n')
    args = build_parser().parse_args(
        [
            "run",
            "--workload",
            "multi-tenant",
            "--cache",
            "scoped-radix",
            "--promote-k",
            "inf",
            "--epoch-s",
            "10",
            "--pinned",
            str(path),
            "--dedup",
            "on",
            "--merge-chains",
        ]
    )
    cache = engine_from_args(args)[0].cache
    assert (cache.kind, cache.promote_k, cache.epoch_s, cache.dedup, cache.merge_chains) == (
        "scoped-radix",
        None,
        10.0,
        True,
        True,
    )
    assert cache.pinned == (tuple(int(i) for i in ByteTokenizer().encode("system")),)
    scoped_args = build_parser().parse_args(["run", "--workload", "random", "--cache", "scoped-radix"])
    defaults = engine_from_args(scoped_args)[0]
    assert (defaults.cache.promote_k, defaults.cache.epoch_s, defaults.cache.pinned, defaults.cache.dedup) == (
        3,
        60.0,
        (),
        False,
    )
    plain = engine_from_args(build_parser().parse_args(["run", "--workload", "random"]))[0]
    assert plain.cache == CacheConfig(kind="radix")


def test_scoped_options_without_args_are_the_defaults() -> None:
    assert scoped_cache_options(argparse.Namespace(), "radix") == {
        "promote_k": 3,
        "epoch_s": 60.0,
        "pinned": (),
        "dedup": False,
        "merge_chains": False,
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"promote_k": 0},
        {"promote_k": 2.0},
        {"epoch_s": 0.0},
        {"epoch_s": math.inf},
        {"epoch_s": math.nan},
        {"epoch_s": True},
        {"pinned": ((),)},
    ],
)
def test_cache_config_refuses_impossible_scoped_settings(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CacheConfig(kind="scoped-radix", **fields)  # type: ignore[arg-type]
    CacheConfig(kind="scoped-radix", promote_k=None, epoch_s=0.5, pinned=((1, 2),))  # NOTE: the control


def test_the_scoped_cache_needs_a_full_attention_model() -> None:
    config = EngineConfig(cache=CacheConfig(kind="scoped-radix"))
    with pytest.raises(ValueError, match="not scoped-radix"):
        config.check_model(sliding_window=16, is_hybrid=True)
    config.check_model(sliding_window=None, is_hybrid=False)  # NOTE: the control: a full-attention model passes


def run_capture(tmp_path: Path, name: str, *cache_args: str) -> tuple[dict[str, object], float]:
    """The cache config recorded in a real run's capture, and the run's token hit rate."""
    capture = tmp_path / f"{name}.db"
    code = main(
        [
            "run",
            "--workload",
            "multi-tenant",
            "--num-requests",
            "40",
            "--level",
            "summary",
            "--capture",
            str(capture),
            "--no-report",
            *cache_args,
        ]
    )
    assert code == 0  # NOTE: 0 also says every idle leak check passed
    with sqlite3.connect(capture) as db:
        config = json.loads(db.execute("SELECT config FROM runs").fetchone()[0])
        prompt, cached = db.execute("SELECT SUM(prompt_len), SUM(cached_tokens) FROM requests").fetchone()
    return config["engine"]["cache"], cached / prompt


def test_run_on_the_scoped_cache_records_its_options_and_isolates(tmp_path: Path) -> None:
    scoped, scoped_hit = run_capture(
        tmp_path, "scoped", "--cache", "scoped-radix", "--promote-k", "inf", "--epoch-s", "30", "--dedup", "off"
    )
    assert scoped == {
        "kind": "scoped-radix",
        "eviction_policy": "lru",
        "eviction_granularity": "leaf",
        "promote_k": None,
        "epoch_s": 30.0,
        "pinned": [],
        "dedup": False,
        "merge_chains": False,
    }
    glob, global_hit = run_capture(tmp_path, "global", "--cache", "radix")
    assert glob["kind"] == "radix"
    # NOTE: multi-tenant prompts share a common and a tenant prompt across users: global sharing
    # serves some of them across principals, k = inf cannot; a session's own turns still hit
    assert 0 < scoped_hit < global_hit, (scoped_hit, global_hit)
