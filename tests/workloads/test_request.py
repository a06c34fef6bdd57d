"""TraceRequest validates itself and holds its own read-only token arrays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvscope.workloads import TraceRequest


def make(**overrides: Any) -> TraceRequest:
    fields: dict[str, Any] = {"rid": "r1", "user": "u", "prompt_ids": [5, 6, 7], "output_len": 2}
    return TraceRequest(**{**fields, **overrides})


def test_prompt_becomes_a_private_read_only_int32_array() -> None:
    source = np.array([5, 6, 7], dtype=np.int64)
    request = make(prompt_ids=source, output_ids=[8, 9], arrival_s=1)
    source[0] = 99
    assert request.prompt_ids.dtype == np.int32 and request.prompt_ids.tolist() == [5, 6, 7]
    assert not request.prompt_ids.flags.writeable
    assert request.output_ids is not None and request.output_ids.dtype == np.int32
    assert request.arrival_s == 1.0 and isinstance(request.arrival_s, float)
    assert request.prompt_len == 3


def test_equality_compares_arrays_by_value() -> None:
    assert make(output_ids=[8, 9]) == make(output_ids=np.array([8, 9]))
    assert hash(make()) == hash(make())
    assert make() != make(prompt_ids=[5, 6, 8])
    assert make() != make(output_ids=[8, 9])
    assert make(arrival_s=0.5) != make(arrival_s=None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rid": ""}, "rid must be a non-empty str"),
        ({"user": 3}, "request r1: user must be a str or None, got int"),
        ({"prompt_ids": []}, "request r1: prompt_ids is empty"),
        ({"prompt_ids": [[1, 2]]}, r"request r1: prompt_ids must be 1-D, got shape \(1, 2\)"),
        ({"prompt_ids": [1.5, 2.0]}, "request r1: prompt_ids must hold integer token ids, got dtype float64"),
        ({"prompt_ids": [1, -2]}, r"request r1: prompt_ids token ids must lie in \[0, 2147483647\]"),
        ({"output_len": 0}, "request r1: output_len must be an int >= 1, got 0"),
        ({"output_len": True}, "request r1: output_len must be an int >= 1, got True"),
        ({"output_ids": [1, 2, 3]}, "request r1: output_ids has 3 tokens but output_len is 2"),
        ({"arrival_s": -0.1}, r"request r1: arrival_s must be finite and >= 0, got -0.1"),
        ({"arrival_s": float("nan")}, "request r1: arrival_s must be finite and >= 0, got nan"),
        ({"arrival_s": "1"}, "request r1: arrival_s must be a number, got str"),
    ],
)
def test_invalid_fields_are_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**overrides)
