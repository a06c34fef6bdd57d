"""The JSONL trace format: one request per line (fields in `trace_fields`), blank lines skipped.

A bad file gets one TraceError whose message is a single line naming the file, the 1-based
line number and the field, e.g. `traces/a.jsonl:7: field 'prompt': token id 600 at index 3
is out of range [0, 512)`; a file with no request is one too. `write_trace` writes the
list-of-ids form, which `read_trace` reads back equal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from kvscope.workloads.request import TraceRequest
from kvscope.workloads.tokenizer import ByteTokenizer
from kvscope.workloads.trace_fields import MAX_SEQ_LEN, FieldError, json_type, parse_record

PathLike = str | os.PathLike[str]


class TraceError(ValueError):
    """A trace file is missing or malformed. The message is one line:
    `{path}:{line}: field '{field}': {problem}`, `{path}:{line}: {problem}` for a line that is
    not a JSON object, or `{path}: {problem}` for the file as a whole."""

    def __init__(self, path: str, problem: str, line: int | None = None, field: str | None = None) -> None:
        where = path if line is None else f"{path}:{line}"
        what = problem if field is None else f"field '{field}': {problem}"
        super().__init__(f"{where}: {what}")
        self.path = path
        self.problem = problem
        self.line = line
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.problem, self.line, self.field))


def read_trace(
    path: PathLike, vocab_size: int, tokenizer: ByteTokenizer | None = None, max_seq_len: int = MAX_SEQ_LEN
) -> list[TraceRequest]:
    """All requests of a JSONL trace (at least one), in file order. Token ids must lie in
    [0, vocab_size); prompt + output fit `max_seq_len` tokens (a run's context length; by
    default a bound beyond any model's); text prompts are encoded by `tokenizer` (a
    ByteTokenizer by default)."""
    if type(vocab_size) is not int or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    if type(max_seq_len) is not int or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
    name = os.fspath(path)
    tokenizer = tokenizer or ByteTokenizer()
    requests: list[TraceRequest] = []
    first_line_of: dict[str, int] = {}
    line_no = 0
    with _open(name) as lines:
        for line_no, raw in enumerate(lines, start=1):
            record = _decode_line(name, line_no, raw)
            if record is None:
                continue
            request = _parse_line(name, line_no, record, vocab_size, tokenizer, max_seq_len)
            if request.rid in first_line_of:
                problem = f"duplicate id {request.rid!r} (first on line {first_line_of[request.rid]})"
                raise TraceError(name, problem, line_no, "id")
            first_line_of[request.rid] = line_no
            requests.append(request)
    if not requests:
        raise TraceError(name, f"no requests (the file {'has only blank lines' if line_no else 'is empty'})")
    return requests


def write_trace(path: PathLike, requests: Iterable[TraceRequest]) -> None:
    """Write `requests` as JSONL, token ids as lists; `arrival_s` only where it is set."""
    with Path(path).open("w", encoding="utf-8", newline="\n") as out:
        for request in requests:
            out.write(json.dumps(_record_of(request), separators=(",", ":")) + "\n")


def _record_of(request: TraceRequest) -> dict[str, Any]:
    record: dict[str, Any] = {"id": request.rid, "user": request.user, "prompt": request.prompt_ids.tolist()}
    if request.output_ids is not None:
        record["output"] = request.output_ids.tolist()
    else:
        record["output_len"] = request.output_len
    if request.arrival_s is not None:
        record["arrival_s"] = request.arrival_s
    return record


def _open(name: str) -> IO[bytes]:
    try:
        return open(name, "rb")  # NOTE: the caller's `with` closes it
    except FileNotFoundError:
        raise TraceError(name, "no such file") from None
    except OSError as exc:
        raise TraceError(name, exc.strerror or str(exc)) from None


def _decode_line(name: str, line_no: int, raw: bytes) -> dict[str, Any] | None:
    """The line's JSON object, or None for a blank line."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TraceError(name, f"not valid UTF-8 (byte {exc.start})", line_no) from None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(name, f"not valid JSON: {exc.msg} (column {exc.colno})", line_no) from None
    if not isinstance(record, dict):
        raise TraceError(name, f"expected a JSON object, got {json_type(record)}", line_no)
    return record


def _parse_line(
    name: str, line_no: int, record: dict[str, Any], vocab_size: int, tokenizer: ByteTokenizer, max_seq_len: int
) -> TraceRequest:
    try:
        return parse_record(record, vocab_size, tokenizer, max_seq_len)
    except FieldError as exc:
        raise TraceError(name, exc.problem, line_no, exc.field) from None
    except ValueError as exc:  # NOTE: parse_record checks every field first; this is a backstop
        raise TraceError(name, str(exc), line_no) from None
