"""`kvscope plan` and `kvscope replay` as a user runs them: the table, --json, and bad input as one
line (ValueError from the handler, or argparse's usage error for a malformed flag value)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app import build_parser, main
from kvscope.app.units import token_counts
from kvscope.planning import GIB, PRESETS, PlanInputs, plan_memory, probe_gpus
from kvscope.workloads import generate, write_trace

ROOT = Path(__file__).resolve().parents[2]


def call(*argv: str) -> str:
    args = build_parser().parse_args(argv)
    out = io.StringIO()
    assert args.func(args, out) == 0
    return out.getvalue()


def test_plan_prints_a_table_with_both_engines() -> None:
    text = call("plan", "--model", "llama-3.1-8b", "--gpu-mem", "80", "--page-size", "16")
    assert "bytes per token  131,072 (128.0 KiB)" in text
    assert "max KV tokens    454,176" in text and "pages / blocks   28,386 of 16" in text
    assert "requests @ 8,192 55" in text and "gpu_memory_utilization 0.9" in text


def test_plan_json_carries_the_same_numbers_as_the_api() -> None:
    data = json.loads(
        call("plan", "--model", "deepseek-v3", "--tp", "8", "--gpu-mem", "141", "--kv-dtype", "fp8", "--json")
    )
    gpu = int(141 * GIB)
    plan = plan_memory(PlanInputs(PRESETS["deepseek-v3"], gpu, gpu, tp_size=8, kv_dtype="fp8"))
    assert data["bytes_per_token"]["all_layers"] == 35_136
    assert data["sglang"]["max_total_num_tokens"] == plan.sglang.max_total_num_tokens
    assert data["vllm"]["num_gpu_blocks"] == plan.vllm.num_gpu_blocks  # type: ignore[union-attr]
    assert data["kv_dtype"] == "fp8" and data["tp_size"] == 8 and data["gpus"] == []


def test_plan_reads_a_config_json_with_given_weights(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256})
    )
    data = json.loads(call("plan", "--model", str(config), "--weights-gib", "1", "--gpu-mem", "2", "--json"))
    assert data["bytes_per_token"]["all_layers"] == 2 * (64 + 64) * 2 * 2
    with pytest.raises(ValueError, match=r"weights of .* are unknown"):
        call("plan", "--model", str(config), "--gpu-mem", "2")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-3.1-8b", "--tp", "3", "--gpu-mem", "80"], "TP 3 does not divide"),
        (["--model", "llama-3-70b", "--gpu-mem", "80"], "do not fit"),
        (["--model", "llama-3.1-8b", "--gpu-mem", "0"], "--gpu-mem must be > 0"),
    ],
)
def test_plan_errors_are_value_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call("plan", *argv)


def test_plan_without_gpu_mem_uses_nvml_or_says_what_to_pass() -> None:
    if probe_gpus():
        assert "free" in call("plan", "--model", "llama-3.1-8b")
    else:
        with pytest.raises(ValueError, match="no GPU visible to NVML; give the memory per GPU with --gpu-mem"):
            call("plan", "--model", "llama-3.1-8b")


def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    write_trace(path, generate("shared-prefix", num_requests=60, seed=2, vocab_size=512))
    return path


def test_replay_prints_replays_beside_the_one_pass_curve(tmp_path: Path) -> None:
    text = call("replay", str(trace_file(tmp_path)), "--capacities", "512,4k", "--convention", "tree", "--workers", "1")
    lines = text.splitlines()
    assert lines[0].startswith("source") and "60 requests" in lines[0]
    assert any("exact for page-granular LRU tail eviction" in line for line in lines)
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("capacity"))
    assert [line.split()[0] for line in lines[header + 1 :]] == ["512", "4,000"]


def test_replay_json_rows_and_curve_only(tmp_path: Path) -> None:
    path = str(trace_file(tmp_path))
    data = json.loads(call("replay", path, "--capacities", "1k", "--page-size", "16", "--workers", "1", "--json"))
    (row,) = data["rows"]
    assert row["capacity"] == 992 and 0 < row["hit_rate"] <= row["curve_hit_rate"] + 1e-12
    assert row["peak_usage_tokens"] <= 992 and data["convention"] == "slots" and data["replayed"]
    grid = json.loads(call("replay", path, "--curve-only", "--json"))
    assert len(grid["rows"]) >= 8 and all("hit_rate" not in r for r in grid["rows"])
    assert grid["rows"][-1]["curve_hit_rate"] == pytest.approx(grid["curve"]["max_hit_rate"])


def test_replay_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert token_counts("10k, 1.5M,200") == [10_000, 1_500_000, 200]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["replay", "t.jsonl", "--capacities", "10x"])
    assert exit_info.value.code == 2 and "'10x' is not a whole token count" in capsys.readouterr().err
    for argv, message in ((["--page-size", "3"], "power of two"), (["--workers", "0"], "--workers must be >= 1")):
        with pytest.raises(ValueError, match=message):
            call("replay", str(trace_file(tmp_path)), *argv)
    with pytest.raises(ValueError, match="no such file"):
        call("replay", str(tmp_path / "missing.jsonl"))


def test_the_math_and_the_curve_never_load_torch(tmp_path: Path) -> None:
    """What the dashboard uses (the math, the presets, the one-pass curve), the `kvscope` parser and a
    curve-only replay run in a fresh interpreter without importing torch."""
    code = (
        "import io, sys\n"
        "from kvscope.planning import PRESETS, PlanInputs, plan_memory, one_pass_curve, load_requests\n"
        "from tests.app.test_plan import call\n"
        f"call('replay', {str(trace_file(tmp_path))!r}, '--curve-only')\n"
        "call('plan', '--model', 'gemma-3-12b', '--gpu-mem', '80')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", "planning math pulled torch in"


def test_kvscope_reports_errors_as_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--tp", "3", "--gpu-mem", "80"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvscope plan: error: TP 3 does not divide the 32 attention heads of llama-3.1-8b"
    )
