"""Bad configs fail before any capture exists: `kvscope run` with an impossible pool, a device
that is not there, an unknown eviction policy, a pace that is not a positive finite rate, or a
trace that cannot run; `kvscope plan` with a config.json whose sizes are not integers >= 1.
Each is one line `kvscope <verb>: error: ...`, exit 2, no traceback, no file written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvscope.app import main
from kvscope.engine.config import EngineConfig, PoolConfig
from kvscope.engine.model import model_config
from kvscope.mem.device import available_memory_bytes, resolve_device

HUGE = "1000000000000000"
RUN = ["run", "--workload", "multi-turn", "--num-requests", "2"]


def error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run `kvscope argv` in this process; assert exit 2 and one stderr line, and return it."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own errors
        code = stop.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    line = err.strip()
    assert line.startswith(f"kvscope {argv[0]}: error: "), line
    return line


def files_in(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--kv-tokens", HUGE],
            r"the pools need 916\.60 PiB \(KV buffers 909\.49 PiB, .*free lists 7\.11 PiB\) "
            r"but (cpu|cuda) has [\d.,]+ [GT]iB available",
        ),
        (["--max-running-requests", "1000000000"], r"req_to_token 7\.46 TiB.* but (cpu|cuda) has [\d.,]+ [GT]iB avail"),
        (["--device", "bogus"], "unknown device 'bogus'; use auto, cpu, cuda or cuda:N"),
        (["--eviction-policy", "bogus"], "unknown eviction policy 'bogus'"),
        (["--rate", "nan"], "argument --rate: must be a finite number > 0, got 'nan'"),
        (["--rate", "inf"], "must be a finite number > 0, got 'inf'"),
        (["--rate", "0"], "must be a finite number > 0, got '0'"),
        (["--rate", "-2"], "must be a finite number > 0, got '-2'"),
        (["--kv-tokens", "12x"], "argument --kv-tokens: '12x' is not a whole token count"),
    ],
)
def test_a_bad_run_config_is_one_line_and_leaves_no_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    for capture in (["--capture", "c.db"], []):  # a named capture, and the default runs/<time>-<label>.db
        line = error_line(capsys, [*RUN, *capture, *flags])
        assert re.search(message, line), line
        assert files_in(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_one_line_and_leaves_no_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    line = error_line(capsys, [*RUN, "--capture", "c.db", "--device", "cuda"])
    assert line.endswith("device 'cuda' requested but no CUDA device is available")
    assert files_in(tmp_path) == []


def test_the_memory_check_counts_the_models_kv_buffers() -> None:
    """1G tokens of the tiny model's KV (1 KiB each) need ~954 GiB: more than this machine has."""
    config = EngineConfig(pool=PoolConfig(kv_size_tokens=10**9), device="cpu")
    if (available_memory_bytes(resolve_device("cpu")) or 0) > 961 * 2**30:
        pytest.skip("this machine has 961 GiB free")
    config.check_model(None, False)  # the index tables alone (~7.5 GiB) fit
    with pytest.raises(ValueError, match=r"the pools need 961\.13 GiB \(KV buffers 953\.67 GiB, .*\) but cpu has"):
        config.check_model(None, False, model_config("tiny"))


def test_a_kv_pool_larger_than_memory_fails_before_the_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    line = error_line(capsys, [*RUN, "--capture", "c.db", "--kv-tokens", "1G"])
    assert "KV buffers 953.67 GiB" in line and files_in(tmp_path) == []


def write_lines(path: Path, *records: object) -> Path:
    path.write_text("".join(f"{json.dumps(r)}\n" if not isinstance(r, str) else r for r in records))
    return path


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (
            [{"id": 1, "prompt": [1, 2, 3], "output_len": 10**12}],
            "t.jsonl:1: field 'output_len': prompt 3 + output 1,000,000,000,000 = 1,000,000,000,003 tokens, "
            "more than the context length (2,048)",
        ),
        (
            [{"id": 1, "prompt": [1], "output_len": 1}, {"id": 2, "prompt": [1, 2], "output_len": 2_047}],
            "t.jsonl:2: field 'output_len': prompt 2 + output 2,047 = 2,049 tokens, "
            "more than the context length (2,048)",
        ),
        ([], "t.jsonl: no requests (the file is empty)"),
        (["\n", "  \n"], "t.jsonl: no requests (the file has only blank lines)"),
    ],
)
def test_a_trace_that_cannot_run_names_its_file_line_and_field(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    records: list[object],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    write_lines(tmp_path / "t.jsonl", *records)
    line = error_line(capsys, ["run", "--trace", "t.jsonl", "--capture", "c.db"])
    assert line == f"kvscope run: error: {message}"
    assert files_in(tmp_path) == ["t.jsonl"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_hidden_layers": 0}, "config field 'num_hidden_layers' must be an integer >= 1, got 0"),
        ({"num_attention_heads": 0}, "config field 'num_attention_heads' must be an integer >= 1, got 0"),
        ({"num_hidden_layers": -4}, "config field 'num_hidden_layers' must be an integer >= 1, got -4"),
        ({"num_key_value_heads": 0}, "config field 'num_key_value_heads' must be an integer >= 1, got 0"),
        ({"head_dim": 0}, "config field 'head_dim' must be an integer >= 1, got 0"),
        ({"num_hidden_layers": 32.5}, "config field 'num_hidden_layers' must be an integer >= 1, got 32.5"),
        ({"num_hidden_layers": "32"}, "config field 'num_hidden_layers' must be an integer >= 1, got '32'"),
        ({"num_hidden_layers": None}, "config has no 'num_hidden_layers'"),
        ({"kv_lora_rank": 512}, "config has no 'qk_rope_head_dim'"),
        ({"hidden_size": 4095}, "hidden_size 4095 is not a multiple of the 32 attention heads"),
        ({"num_key_value_heads": 3}, "32 attention heads are not a multiple of the 3 KV heads"),
    ],
)
def test_plan_on_a_config_json_with_bad_sizes_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, object], message: str
) -> None:
    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096, **fields}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    line = error_line(capsys, ["plan", "--model", str(path), "--gpu-mem", "80", "--weights-gib", "16"])
    assert message in line


def test_the_real_cli_prints_one_line_and_writes_nothing(tmp_path: Path) -> None:
    """The console entry point end to end, for the two cases that used to hang or crash the allocator."""
    for flags in (["--rate", "nan"], ["--kv-tokens", HUGE]):
        out = subprocess.run(
            [sys.executable, "-m", "kvscope", *RUN, "--capture", "c.db", *flags],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=300,
            check=False,
        )
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert out.stderr.startswith("kvscope run: error: ") and files_in(tmp_path) == []
