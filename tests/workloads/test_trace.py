"""The JSONL trace format: what reads, what round-trips, and one exact error per bad line."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.workloads import ByteTokenizer, TraceError, TraceRequest, read_trace, write_trace

VOCAB_SIZE = 512
GOOD = '{"id": "a", "prompt": [5, 6], "output_len": 2}'


def trace_file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_ids_text_and_optional_fields(tmp_path: Path) -> None:
    path = trace_file(
        tmp_path,
        '{"id": 7, "user": "alice", "prompt": [5, 6, 7], "output": [8, 9], "arrival_s": 0.25}',
        "",
        '{"id": "b", "prompt": "héllo", "output_len": 4, "user": null, "note": "extra fields are ignored"}',
    )
    first, second = read_trace(path, VOCAB_SIZE)
    assert first == TraceRequest("7", "alice", np.array([5, 6, 7]), 2, np.array([8, 9]), 0.25)
    assert second == TraceRequest("b", None, ByteTokenizer().encode("héllo"), 4, None, None)


def test_write_then_read_gives_the_same_requests(tmp_path: Path) -> None:
    requests = [
        TraceRequest("x", "u1", np.array([3, 4, 5]), 3, np.array([6, 7, 8]), 0.1),
        TraceRequest("y", None, np.array([511]), 5, None, None),
    ]
    path = tmp_path / "out.jsonl"
    write_trace(path, requests)
    assert read_trace(path, VOCAB_SIZE) == requests
    assert "arrival_s" not in json.loads(path.read_text().splitlines()[1])


token_lists = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=20)


@st.composite
def trace_requests(draw: st.DrawFn, rid: str) -> TraceRequest:
    outputs = draw(st.none() | token_lists)
    output_ids = None if outputs is None else np.array(outputs)
    output_len = len(outputs) if outputs is not None else draw(st.integers(1, 64))
    arrival_s = draw(st.none() | st.floats(0, 1e6, allow_nan=False))
    user = draw(st.none() | st.text(max_size=8))
    return TraceRequest(rid, user, np.array(draw(token_lists)), output_len, output_ids, arrival_s)


@settings(max_examples=40, deadline=None)  # NOTE: at least one request: an empty trace is an error
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=5).flatmap(
        lambda ks: st.tuples(*(trace_requests(f"r{k}") for k in ks))
    )
)
def test_any_requests_round_trip(tmp_path_factory: pytest.TempPathFactory, requests: tuple[TraceRequest, ...]) -> None:
    unique = list({r.rid: r for r in requests}.values())
    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    write_trace(path, unique)
    assert read_trace(path, VOCAB_SIZE) == unique


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(TraceError) as exc:
        read_trace(path, VOCAB_SIZE)
    assert str(exc.value) == f"{path}: no such file"


def test_error_survives_pickling(tmp_path: Path) -> None:
    error = TraceError("t.jsonl", "missing", 3, "id")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == "t.jsonl:3: field 'id': missing" and (copy.line, copy.field) == (3, "id")


DROP = object()


def line(**fields: object) -> str:
    """A JSON line: id "a", prompt [5], output_len 1, with `fields` replacing (DROP removing) those."""
    record = {"id": "a", "prompt": [5], "output_len": 1, **fields}
    return json.dumps({key: value for key, value in record.items() if value is not DROP})


# NOTE: each case = (lines of the file, line number, field or None, problem); line numbers count blank lines.
MALFORMED: dict[str, tuple[list[str], int, str | None, str]] = {
    "not_json": ([GOOD, "id=b prompt=5"], 2, None, "not valid JSON: Expecting value (column 1)"),
    "not_an_object": (["[1, 2]"], 1, None, "expected a JSON object, got array"),
    "missing_id": ([line(id=DROP)], 1, "id", "missing"),
    "id_wrong_type": ([line(id=[1])], 1, "id", "expected a string or an integer, got array"),
    "duplicate_id": ([GOOD, "", GOOD], 3, "id", "duplicate id 'a' (first on line 1)"),
    "missing_prompt": ([line(prompt=DROP)], 1, "prompt", "missing"),
    "prompt_wrong_type": ([line(prompt=5)], 1, "prompt", "expected a list of token ids or a string, got integer"),
    "prompt_empty": ([line(prompt=[])], 1, "prompt", "empty list"),
    "prompt_token_out_of_range": (
        [line(prompt=[5, 6, 512])],
        1,
        "prompt",
        "token id 512 at index 2 is out of range [0, 512)",
    ),
    "prompt_token_negative": ([line(prompt=[-1])], 1, "prompt", "token id -1 at index 0 is out of range [0, 512)"),
    "prompt_token_not_an_int": (
        [line(prompt=[5, 6.0])],
        1,
        "prompt",
        "element at index 1 is number, expected an integer token id",
    ),
    "prompt_token_bool": (
        [line(prompt=[5, True])],
        1,
        "prompt",
        "element at index 1 is boolean, expected an integer token id",
    ),
    "output_token_out_of_range": (
        [line(output_len=DROP, output=[1, 2, 3, 999])],
        1,
        "output",
        "token id 999 at index 3 is out of range [0, 512)",
    ),
    "output_wrong_type": ([line(output_len=DROP, output="x")], 1, "output", "expected a list of token ids, got string"),
    "output_and_output_len": (
        [line(output=[1])],
        1,
        "output",
        "give exactly one of 'output' and 'output_len', not both",
    ),
    "neither_output_nor_output_len": (
        [line(output_len=DROP)],
        1,
        "output",
        "missing (give 'output' token ids or 'output_len')",
    ),
    "output_len_zero": ([line(output_len=0)], 1, "output_len", "must be >= 1, got 0"),
    "output_len_wrong_type": ([line(output_len="4")], 1, "output_len", "expected an integer, got string"),
    "negative_arrival_s": ([line(arrival_s=-1)], 1, "arrival_s", "must be a finite number >= 0, got -1"),
    "nan_arrival_s": ([line(arrival_s=float("nan"))], 1, "arrival_s", "must be a finite number >= 0, got nan"),
    "user_not_a_string": ([line(user=42)], 1, "user", "expected a string or null, got integer"),
    "not_utf8": ([GOOD, '{"id": "\xff"}'], 2, None, "not valid UTF-8 (byte 8)"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_line_names_file_line_and_field(tmp_path: Path, case: str) -> None:
    lines, line_no, field, problem = MALFORMED[case]
    path = tmp_path / "trace.jsonl"
    path.write_bytes("\n".join(lines).encode("latin-1" if case == "not_utf8" else "utf-8"))
    with pytest.raises(TraceError) as exc:
        read_trace(path, VOCAB_SIZE)
    where = f"{path}:{line_no}: " + ("" if field is None else f"field '{field}': ")
    assert str(exc.value) == where + problem
    assert (exc.value.line, exc.value.field) == (line_no, field)
    assert "\n" not in str(exc.value)


def test_text_prompt_past_a_small_vocabulary_is_rejected(tmp_path: Path) -> None:
    path = trace_file(tmp_path, '{"id": "a", "prompt": "ab~", "output_len": 1}')
    with pytest.raises(TraceError) as exc:
        read_trace(path, vocab_size=120)
    assert str(exc.value) == (
        f"{path}:1: field 'prompt': text encodes to token id 129 at index 2, out of range [0, 120) "
        "(the tokenizer needs vocab_size >= 259)"
    )
