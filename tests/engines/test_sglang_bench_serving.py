"""SGLang 0.5.23's own benchmark client, `python -m sglang.bench_serving --backend sglang` (its
default backend: SGLang's native /generate, streamed), against a real `kvscope serve` with one
rank and with two: its warm-up, every request and its --flush-cache (SGLang's /flush_cache after
the warm-up) complete, and the capture shows the flush as resets.

It runs in the SGLang venv (KVSCOPE_SGLANG_PYTHON) through tests/engines/sglang_bench_driver.py;
the random dataset samples from a small local ShareGPT-shaped file and a local byte-level
tokenizer, so nothing is downloaded (HF_HUB_OFFLINE)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvscope.telemetry import EventKind
from kvscope.telemetry.queries import Capture
from tests.engines.test_sglang_probe import SGLANG_PYTHON
from tests.server.serving import serving

DRIVER = Path(__file__).with_name("sglang_bench_driver.py")
NUM_PROMPTS = 8
BENCH_TIMEOUT_S = 300
pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(SGLANG_PYTHON).exists(), reason=f"no SGLang venv at {SGLANG_PYTHON}: `make test-engines` makes it"
    ),
]


def sharegpt_file(path: Path) -> Path:
    """Conversations in ShareGPT's shape, which bench_serving's random dataset samples tokens from."""
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}: what lies between {i - 1} and {i + 1}, and why?"},
                {"from": "gpt", "value": f"The number {i}, one step from each."},
            ]
        }
        for i in range(16)
    ]
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("dp_size", ["1", "2"])
def test_sglang_bench_serving_completes_against_kvscope_serve(tmp_path: Path, dp_size: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    made = subprocess.run(
        [SGLANG_PYTHON, str(DRIVER), "--make-tokenizer", str(tmp_path / "tokenizer")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert made.returncode == 0, made.stderr
    with serving(tmp_path / "serve.db", "--dp-size", dp_size) as server:
        out = tmp_path / "bench.jsonl"
        bench = subprocess.run(
            [
                SGLANG_PYTHON,
                str(DRIVER),
                "--backend",
                "sglang",
                "--base-url",
                server.url,
                "--dataset-name",
                "random",
                "--dataset-path",
                str(sharegpt_file(tmp_path / "sharegpt.json")),
                "--tokenizer",
                str(tmp_path / "tokenizer"),
                "--num-prompts",
                str(NUM_PROMPTS),
                "--random-input-len",
                "32",
                "--random-output-len",
                "8",
                "--random-range-ratio",
                "1",
                "--flush-cache",
                "--output-file",
                str(out),
                "--disable-tqdm",
            ],
            capture_output=True,
            text=True,
            timeout=BENCH_TIMEOUT_S,
            env=env,
        )
        assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
        code, printed = server.stop()
    assert code == 0, printed
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["backend"] == "sglang" and result["completed"] == NUM_PROMPTS, result
    assert result["total_output_tokens"] == NUM_PROMPTS * 8  # ignore_eos: every request ran its 8 tokens
    capture = Capture(tmp_path / "serve.db")
    runs = capture.runs().id.tolist()
    assert len(runs) == int(dp_size)
    requests = sum(len(capture.requests(run)) for run in runs)
    assert requests == NUM_PROMPTS + 1  # and the warm-up
    resets = sum(
        int((capture.events(run, kinds=[EventKind.EVICT], limit=None, columns=["reason"]).reason == "reset").sum())
        for run in runs
    )
    assert resets > 0  # the flush after the warm-up emptied the cache the warm-up filled
