"""One decoded trace record (a JSON object) -> TraceRequest; every violation names its field.

NOTE: the record
    id          required  str or int (an int becomes its decimal str); not empty
    user        optional  str or null
    prompt      required  non-empty list of int token ids in [0, vocab_size), or non-empty text
    output      one of    non-empty list of int token ids in [0, vocab_size) (forced outputs)
    output_len  one of    int >= 1
    arrival_s   optional  finite number >= 0 (order across lines is not checked)
A null value counts as an absent field. Unknown fields are ignored. Prompt + output must fit
`max_seq_len` tokens: the run's context length when the reader is given one, else MAX_SEQ_LEN,
beyond any model's context; the longer part is the field named.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import numpy as np

from kvscope.workloads.request import TOKEN_DTYPE, TraceRequest
from kvscope.workloads.tokenizer import ByteTokenizer

MAX_SEQ_LEN = 2**24  # tokens (16,777,216): beyond any model's context (the longest are 10M)
_JSON_TYPES: dict[type, str] = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


class FieldError(Exception):
    """A record's field is wrong; the trace reader adds the file and line."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"field '{field}': {problem}")
        self.field = field
        self.problem = problem


def json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def parse_record(
    record: dict[str, Any], vocab_size: int, tokenizer: ByteTokenizer, max_seq_len: int = MAX_SEQ_LEN
) -> TraceRequest:
    """Fields are checked in the order of the note above; the first bad one is reported."""
    rid, user = parse_id(record), parse_user(record)
    prompt_ids = parse_prompt(record, vocab_size, tokenizer)
    output_len, output_ids = parse_output(record, vocab_size)
    check_seq_len(len(prompt_ids), output_len, "output_len" if output_ids is None else "output", max_seq_len)
    return TraceRequest(rid, user, prompt_ids, output_len, output_ids, parse_arrival(record))


def check_seq_len(prompt_len: int, output_len: int, output_field: str, max_seq_len: int) -> None:
    """Prompt + output within `max_seq_len`; else the field of the longer part is named."""
    total = prompt_len + output_len
    if total <= max_seq_len:
        return
    limit = "beyond any model's context (limit " if max_seq_len == MAX_SEQ_LEN else "more than the context length ("
    what = f"prompt {prompt_len:,} + output {output_len:,} = {total:,} tokens, {limit}{max_seq_len:,})"
    raise FieldError(output_field if output_len >= prompt_len else "prompt", what)


def parse_id(record: dict[str, Any]) -> str:
    value = record.get("id")
    if value is None:
        raise FieldError("id", "missing")
    if type(value) is int:
        return str(value)
    if not isinstance(value, str):
        raise FieldError("id", f"expected a string or an integer, got {json_type(value)}")
    if not value:
        raise FieldError("id", "empty string")
    return value


def parse_user(record: dict[str, Any]) -> str | None:
    value = record.get("user")
    if value is not None and not isinstance(value, str):
        raise FieldError("user", f"expected a string or null, got {json_type(value)}")
    return value


def parse_prompt(record: dict[str, Any], vocab_size: int, tokenizer: ByteTokenizer) -> np.ndarray:
    value = record.get("prompt")
    if value is None:
        raise FieldError("prompt", "missing")
    if isinstance(value, list):
        return parse_token_ids(value, "prompt", vocab_size)
    if not isinstance(value, str):
        raise FieldError("prompt", f"expected a list of token ids or a string, got {json_type(value)}")
    if not value:
        raise FieldError("prompt", "empty string")
    ids = tokenizer.encode(value)
    too_big = np.flatnonzero(ids >= vocab_size)
    if too_big.size:
        k = int(too_big[0])
        raise FieldError(
            "prompt",
            f"text encodes to token id {ids[k]} at index {k}, out of range [0, {vocab_size}) "
            f"(the tokenizer needs vocab_size >= {tokenizer.vocab_size})",
        )
    return ids


def parse_output(record: dict[str, Any], vocab_size: int) -> tuple[int, np.ndarray | None]:
    """(output_len, forced output ids or None)."""
    output, output_len = record.get("output"), record.get("output_len")
    if output is not None and output_len is not None:
        raise FieldError("output", "give exactly one of 'output' and 'output_len', not both")
    if output is not None:
        ids = parse_token_ids(output, "output", vocab_size)
        return int(ids.size), ids
    if output_len is None:
        raise FieldError("output", "missing (give 'output' token ids or 'output_len')")
    if type(output_len) is not int:
        raise FieldError("output_len", f"expected an integer, got {json_type(output_len)}")
    if output_len < 1:
        raise FieldError("output_len", f"must be >= 1, got {output_len}")
    return output_len, None


def parse_arrival(record: dict[str, Any]) -> float | None:
    value = record.get("arrival_s")
    if value is None:
        return None
    if type(value) not in (int, float):
        raise FieldError("arrival_s", f"expected a number, got {json_type(value)}")
    if not math.isfinite(value) or value < 0:
        raise FieldError("arrival_s", f"must be a finite number >= 0, got {value}")
    return float(value)


def parse_token_ids(value: object, field: str, vocab_size: int) -> np.ndarray:
    if not isinstance(value, list):
        raise FieldError(field, f"expected a list of token ids, got {json_type(value)}")
    if not value:
        raise FieldError(field, "empty list")
    ids = _all_valid_ids(value, vocab_size)
    if ids is None:
        _raise_first_bad_id(value, field, vocab_size)
    return ids


def _all_valid_ids(value: list[Any], vocab_size: int) -> np.ndarray | None:
    """Fast path: the ids as an int32 array when every element is an in-range int, else None."""
    if set(map(type, value)) != {int}:
        return None
    try:
        ids = np.array(value, dtype=np.int64)
    except OverflowError:
        return None
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        return None
    return ids.astype(TOKEN_DTYPE)


def _raise_first_bad_id(value: list[Any], field: str, vocab_size: int) -> NoReturn:
    for k, token_id in enumerate(value):
        if type(token_id) is not int:
            raise FieldError(field, f"element at index {k} is {json_type(token_id)}, expected an integer token id")
        if not 0 <= token_id < vocab_size:
            raise FieldError(field, f"token id {token_id} at index {k} is out of range [0, {vocab_size})")
    raise AssertionError(f"{field}: no bad token id found in a list the fast path rejected")
