"""The `kvscope` command line as a user meets it: --version, sizes with unit suffixes, help
without doubled defaults, argparse errors on one line, and `replay` (its --run selector, its
capacities, a capture's own page size, labelled conventions in text and JSON, no torch in the
parent process, and a quiet Ctrl-C while its workers start)."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvscope.app import build_parser, main
from kvscope.app.units import byte_size, token_count
from kvscope.planning import CONVENTION_MEANINGS, EXACTNESS
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.workloads import generate, write_trace

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def cli(*argv: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *argv],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=timeout,
        check=False,
    )


def test_version_prints_the_installed_version() -> None:
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kvscope {importlib.metadata.version('kvscope')}"


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("4096", 4096),
        ("64k", 64_000),
        ("64K", 64_000),
        ("1.5M", 1_500_000),
        ("2G", 2 * 10**9),
        ("128Ki", 131_072),
        ("4Mi", 4 * 2**20),
        ("1.1k", 1100),
        (" 200 ", 200),
    ],
)
def test_token_counts_take_decimal_and_binary_suffixes(text: str, tokens: int) -> None:
    assert token_count(text) == tokens


@pytest.mark.parametrize("text", ["1.0001k", "1e6", "nan", "inf", "-1", "k", "12x", "", "1,000"])
def test_a_token_count_that_is_not_whole_is_rejected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a whole token count"):
        token_count(text)


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("80", 80 * GIB),
        ("80G", 80 * GIB),
        ("80GiB", 80 * GIB),
        ("80gi", 80 * GIB),
        ("79.6", int(79.6 * GIB)),
        ("512MiB", 512 * 2**20),
        ("512M", 512 * 2**20),
        ("80GB", 80 * 10**9),
        ("1TB", 10**12),
        ("1T", 2**40),
        ("4096B", 4096),
        ("0", 0),
    ],
)
def test_memory_sizes_take_units_and_a_bare_number_is_gib(text: str, num_bytes: int) -> None:
    assert byte_size(text) == num_bytes


@pytest.mark.parametrize("text", ["inf", "nan", "-1", "80 GiBs", "80X", "1e3"])
def test_a_bad_memory_size_is_rejected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a memory size"):
        byte_size(text)


def test_size_flags_parse_their_units() -> None:
    parser = build_parser()
    run = parser.parse_args(
        [
            "run",
            "--workload",
            "random",
            "--kv-tokens",
            "64k",
            "--max-context-len",
            "8Ki",
            "--chunked-prefill-size",
            "1k",
            "--max-running-requests",
            "1k",
        ]
    )
    assert (run.kv_tokens, run.max_context_len, run.chunked_prefill_size, run.max_running_requests) == (
        64_000,
        8192,
        1000,
        1000,
    )
    plan = parser.parse_args(
        [
            "plan",
            "--model",
            "llama-3.1-8b",
            "--gpu-mem",
            "80G",
            "--weights-gib",
            "16GB",
            "--context-len",
            "128Ki",
            "--vllm-activation-gib",
            "512MiB",
        ]
    )
    assert (plan.gpu_mem, plan.weights_gib, plan.context_len, plan.vllm_activation_gib) == (
        80 * GIB,
        16 * 10**9,
        131_072,
        512 * 2**20,
    )


def test_plan_gives_the_same_numbers_for_every_spelling_of_a_size() -> None:
    outputs = []
    for size in ("80", "80G", "80GiB", "81920MiB"):
        out = io.StringIO()
        args = build_parser().parse_args(["plan", "--model", "llama-3.1-8b", "--gpu-mem", size, "--json"])
        assert args.func(args, out) == 0
        outputs.append(json.loads(out.getvalue()))
    assert all(o == outputs[0] for o in outputs) and outputs[0]["gpu"]["free_bytes"] == 80 * GIB


def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += parsers(child)
    return found


def test_no_help_states_a_default_twice_or_a_default_of_none() -> None:
    for parser in parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help in (None, argparse.SUPPRESS):
                continue
            text = formatter._expand_help(action)
            assert text.lower().count("default") <= 1, f"{parser.prog} {action.option_strings}: {text}"
            assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text


def visible_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions if action.help != argparse.SUPPRESS for flag in action.option_strings}


# one name per concept: the verbs that take it and the name each shows in --help
CONCEPTS = {
    "requests per second": (("run", "load"), "--rate"),
    "stop after seconds": (("load", "attach"), "--duration-s"),
    "HTTP timeout": (("load", "attach"), "--timeout-s"),
    "eviction granularity": (("run", "serve", "replay"), "--eviction-granularity"),
    "eviction policy": (("run", "serve", "replay"), "--eviction-policy"),
    "SWA pool per full pool token": (("run", "serve", "plan"), "--swa-full-tokens-ratio"),
}
# the older spellings, still parsed and hidden from --help: (verb and required arguments, old, new, a value)
OLD_SPELLINGS = [
    (["run", "--workload", "random"], "--pace", "--rate", "8"),
    (["run", "--workload", "random"], "--swa-ratio", "--swa-full-tokens-ratio", "0.5"),
    (["serve"], "--swa-ratio", "--swa-full-tokens-ratio", "0.5"),
    (["replay", "t.jsonl"], "--eviction", "--eviction-granularity", "leaf"),
    (["replay", "t.jsonl"], "--policy", "--eviction-policy", "fifo"),
    (["load", "--url", "http://127.0.0.1:1", "--workload", "random"], "--duration", "--duration-s", "2.5"),
    (["load", "--url", "http://127.0.0.1:1", "--workload", "random"], "--timeout", "--timeout-s", "7"),
    (["demo"], "--delay", "--delay-s", "0.1"),
]


def test_every_verb_names_one_concept_with_one_flag() -> None:
    verbs = {p.prog.split()[-1]: p for p in parsers(build_parser())}
    for concept, (names, flag) in CONCEPTS.items():
        for verb in names:
            assert flag in visible_flags(verbs[verb]), f"{verb} lacks {flag} ({concept})"
    hidden = {old for _, old, _, _ in OLD_SPELLINGS}
    for parser in parsers(build_parser()):
        assert not visible_flags(parser) & hidden, parser.prog


@pytest.mark.parametrize(
    ("argv", "old", "new", "value"), OLD_SPELLINGS, ids=[f"{argv[0]}{old}" for argv, old, _, _ in OLD_SPELLINGS]
)
def test_an_old_flag_spelling_still_works_and_means_the_same(argv: list[str], old: str, new: str, value: str) -> None:
    parser = build_parser()
    with_old, with_new, with_neither = (
        vars(parser.parse_args([*argv, *flags])) for flags in ([old, value], [new, value], [])
    )
    assert with_old == with_new != with_neither
    verb = next(p for p in parsers(parser) if p.prog == f"kvscope {argv[0]}")
    shown = set(re.findall(r"(?<![\w-])--[\w-]+", verb.format_help()))
    assert old not in shown and new in shown
    if value != "fifo":  # NOTE: a policy name is checked when the replay starts, not by argparse
        bad = cli(*argv, old, "nan" if value[0].isdigit() else "x")
        assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and f"argument {old}:" in bad.stderr


def test_an_argparse_error_is_one_line() -> None:
    out = cli("replay", "t.jsonl", "--capacities", "10x")
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "kvscope replay: error: argument --capacities: '10x' is not a whole token count (write 4096, 4k, 1.5M or 128Ki)"
    ]


# -- replay ---------------------------------------------------------------------------------------


def trace_file(tmp_path: Path, num_requests: int = 60) -> Path:
    path = tmp_path / "trace.jsonl"
    write_trace(path, generate("shared-prefix", num_requests=num_requests, seed=2, vocab_size=512))
    return path


def replay_json(*argv: str) -> dict[str, object]:
    out = io.StringIO()
    args = build_parser().parse_args(["replay", *argv, "--json"])
    assert args.func(args, out) == 0
    data: dict[str, object] = json.loads(out.getvalue())
    return data


def test_the_default_capacities_start_at_the_longest_request_under_the_slots_convention(tmp_path: Path) -> None:
    data = replay_json(str(trace_file(tmp_path)), "--curve-only")  # slots is the default convention
    longest = data["longest_request_tokens"]
    assert longest == 199
    tree = replay_json(str(trace_file(tmp_path)), "--curve-only", "--convention", "tree")
    assert min(r["capacity"] for r in tree["rows"]) < longest  # type: ignore[index, union-attr]
    replayed = replay_json(str(trace_file(tmp_path)), "--workers", "2")
    rows = replayed["rows"]
    assert rows and all(r["capacity"] >= longest and r["num_skipped"] == 0 for r in rows)  # type: ignore[union-attr]


def test_a_given_capacity_below_the_longest_request_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(trace_file(tmp_path)), "--capacities", "100,1k"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvscope replay: error: capacity 100 is below the longest request (199 tokens in whole pages), which a pool "
        "of that many slots cannot serve; give capacities >= that, or --convention tree"
    )


def capture_of_trace(tmp_path: Path, page_size: int) -> Path:
    """A capture whose one run recorded the trace and page size (what `kvscope run` writes)."""
    db = tmp_path / "run.db"
    config = {
        "workload": {"name": None, "trace": str(trace_file(tmp_path))},
        "model": {"vocab_size": 512},
        "engine": {"pool": {"page_size": page_size}},
    }
    SQLRecorder(db, level="summary", config=config).close()
    return db


def test_a_capture_replays_at_its_own_page_size_unless_one_is_given(tmp_path: Path) -> None:
    db = str(capture_of_trace(tmp_path, page_size=16))
    own = replay_json(db, "--curve-only")
    assert own["page_size"] == 16 and own["run"] == 1
    assert all(r["capacity"] % 16 == 0 for r in own["rows"])  # type: ignore[index, union-attr]
    assert replay_json(db, "--curve-only", "--page-size", "4")["page_size"] == 4
    assert replay_json(str(trace_file(tmp_path)), "--curve-only")["page_size"] == 1


def test_replay_selects_a_run_with_run_and_keeps_run_id_as_a_hidden_alias(tmp_path: Path) -> None:
    db = str(capture_of_trace(tmp_path, page_size=1))
    assert replay_json(db, "--curve-only", "--run", "1")["run"] == 1
    assert replay_json(db, "--curve-only", "--run-id", "1")["run"] == 1
    help_text = cli("replay", "--help").stdout
    assert "--run RUN" in help_text and "--run-id" not in help_text
    with pytest.raises(ValueError, match="no run 7"):
        replay_json(db, "--curve-only", "--run", "7")


def test_replay_labels_its_conventions_in_text_and_json(tmp_path: Path) -> None:
    path = str(trace_file(tmp_path))
    out = io.StringIO()
    args = build_parser().parse_args(["replay", path, "--capacities", "1k", "--workers", "1"])
    assert args.func(args, out) == 0
    conventions = next(line for line in out.getvalue().splitlines() if line.startswith("conventions"))
    assert f"replays: slots convention, {CONVENTION_MEANINGS['slots']}" in conventions
    assert f"one-pass: tree convention, {CONVENTION_MEANINGS['tree']}" in conventions
    data = replay_json(path, "--capacities", "1k", "--workers", "1", "--convention", "tree")
    assert data["conventions"] == {
        "replays": {"name": "tree", "meaning": CONVENTION_MEANINGS["tree"]},
        "curve": {"name": "tree", "meaning": CONVENTION_MEANINGS["tree"], "exactness": EXACTNESS},
    }
    (row,) = data["rows"]  # type: ignore[misc]
    assert set(row) == {
        "capacity",
        "curve_hit_rate",
        "curve_hit_tokens",
        "hit_rate",
        "hit_tokens",
        "evicted_tokens",
        "peak_usage_tokens",
        "num_skipped",
        "wall_s",
    }


def test_plan_and_replay_never_load_torch(tmp_path: Path) -> None:
    """Replays run in worker processes; the verb's own process stays free of torch."""
    code = (
        "import sys\n"
        "from kvscope.app.cli import main\n"
        f"assert main(['replay', {str(trace_file(tmp_path))!r}, '--capacities', '1k,2k', '--workers', '2']) == 0\n"
        "assert main(['plan', '--model', 'meta-llama/Llama-3.1-8B-Instruct', '--gpu-mem', '80GiB']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", "plan or replay pulled torch in"


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def loads_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_ctrl_c_while_replay_workers_start_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) once a worker is
    loading torch: the workers print nothing, the verb prints one line and exits 130."""
    trace = trace_file(tmp_path, num_requests=200)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "replay", str(trace), "--capacities", "1k,2k,3k", "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and not any(loads_torch(c) for c in children(proc.pid)):
            assert time.monotonic() < deadline, "no worker started loading torch"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert err.splitlines() == ["kvscope replay: interrupted"] and proc.returncode == 130, err
