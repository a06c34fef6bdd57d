"""Trace lengths: prompt + output must fit the reader's context length (a run's, or by default
a bound beyond any model's), and a trace holds at least one request. Each violation is one
TraceError naming the file, the line and the field of the longer part, before anything the
size of the request is allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.workloads import TraceError, read_trace
from kvscope.workloads.trace_fields import MAX_SEQ_LEN

VOCAB_SIZE = 512


def trace(tmp_path: Path, *records: dict[str, object]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def error_of(path: Path, **kwargs: int) -> str:
    with pytest.raises(TraceError) as exc:
        read_trace(path, VOCAB_SIZE, **kwargs)  # type: ignore[arg-type]
    return str(exc.value)


def test_an_output_beyond_any_context_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    """10^12 output tokens would be a 3.6 TiB array; the reader refuses it by its length."""
    path = trace(
        tmp_path, {"id": "a", "prompt": [1, 2], "output_len": 1}, {"id": "b", "prompt": [1, 2, 3], "output_len": 10**12}
    )
    assert error_of(path) == (
        f"{path}:2: field 'output_len': prompt 3 + output 1,000,000,000,000 = "
        "1,000,000,000,003 tokens, beyond any model's context (limit 16,777,216)"
    )


def test_the_bound_itself_is_accepted(tmp_path: Path) -> None:
    (request,) = read_trace(trace(tmp_path, {"id": 1, "prompt": [7], "output_len": MAX_SEQ_LEN - 1}), VOCAB_SIZE)
    assert request.output_len == MAX_SEQ_LEN - 1


@pytest.mark.parametrize(
    ("record", "field", "what"),
    [
        ({"prompt": [1] * 3, "output_len": 30}, "output_len", "prompt 3 + output 30 = 33 tokens"),
        ({"prompt": [1] * 3, "output": [2] * 30}, "output", "prompt 3 + output 30 = 33 tokens"),
        ({"prompt": [1] * 30, "output_len": 3}, "prompt", "prompt 30 + output 3 = 33 tokens"),
        ({"prompt": "x" * 30, "output_len": 3}, "prompt", "prompt 30 + output 3 = 33 tokens"),
    ],
)
def test_a_request_longer_than_the_runs_context_names_the_longer_part(
    tmp_path: Path, record: dict[str, object], field: str, what: str
) -> None:
    path = trace(tmp_path, {"id": 1, "prompt": [1], "output_len": 1}, {"id": 2, **record})
    assert error_of(path, max_seq_len=32) == f"{path}:2: field '{field}': {what}, more than the context length (32)"
    assert len(read_trace(path, VOCAB_SIZE, max_seq_len=33)) == 2


@pytest.mark.parametrize(("text", "why"), [("", "is empty"), ("\n \n\n", "has only blank lines")])
def test_a_trace_without_requests_names_its_file(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    assert error_of(path) == f"{path}: no requests (the file {why})"
