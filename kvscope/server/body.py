"""A request body a handler can trust (docs/serve.md, errors): JSON, UTF-8, finite numbers, integers
of at most MAX_INT_DIGITS digits, at most MAX_JSON_DEPTH levels, no lone UTF-16 surrogate in any
string or key; anything else is an ApiError 400 naming the field's path (e.g. "messages[0].content")."""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from kvscope.server.errors import ApiError

MAX_JSON_DEPTH = 64  # NOTE: OpenAI bodies nest a few levels (a tool's JSON schema a dozen or so)
MAX_INT_DIGITS = 4300  # NOTE: Python's own limit for int(str); past it a number is refused by name


async def read_json(request: Request) -> Any:
    """The body as JSON values a handler can trust (see the module NOTE), or ApiError 400."""
    return decode_json(await request.body())


class BadNumber:
    """A JSON number no handler should see (NaN, an infinity, an integer of too many digits):
    decode_json's placeholder until check_json names its field."""

    def __init__(self, text: str) -> None:
        self.text = text

    def why(self) -> str:
        if self.text.lstrip("-").isdigit():
            return f"is an integer of {len(self.text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})"
        return f"is {self.text[:20]}, not a finite number"


def _int(text: str) -> int | BadNumber:
    return int(text) if len(text) <= MAX_INT_DIGITS else BadNumber(text)


def _float(text: str) -> float | BadNumber:
    value = float(text)
    return value if math.isfinite(value) else BadNumber(text)


def decode_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=BadNumber)
    except RecursionError:
        raise too_deep(deep_field(raw)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON: {err}", code="invalid_json") from None
    check_json(body)
    return body


def too_deep(field: str | None) -> ApiError:
    where = f" (in '{field}')" if field else ""
    return ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels{where}", param=field, code="invalid_json")


def deep_field(raw: bytes) -> str | None:
    """The top-level key of a JSON object whose value nests deeper than MAX_JSON_DEPTH (a body
    too deep for the parser to read), found by scanning its bytes; None when there is none."""
    depth, in_string, escaped, start, key = 0, False, False, 0, None
    for i, byte in enumerate(raw):
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # the closing quote
                in_string = False
                if depth == 1:
                    key = raw[start : i + 1]
        elif byte == 0x22:
            in_string, start = True, i
        elif byte in b"[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                break
        elif byte in b"]}":
            depth -= 1
    else:
        return None
    try:
        name = json.loads(key) if key is not None and raw.lstrip()[:1] == b"{" else None
    except ValueError:
        return None
    return name if isinstance(name, str) and _is_text(name) else None


def check_json(body: Any) -> None:
    """ApiError 400 naming the first field that nests too deep, is a BadNumber or holds a lone
    surrogate (in its value or its key). Iterative: a deep body cannot exhaust the stack."""
    if isinstance(body, BadNumber):
        raise ApiError(400, f"the body {body.why()}", code="invalid_json")
    if isinstance(body, str) and not _is_text(body):
        raise ApiError(400, "the body holds a lone UTF-16 surrogate, which is not text", code="invalid_json")
    stack: list[tuple[Any, str, int]] = [(body, "", 1)] if isinstance(body, dict | list) else []
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise too_deep(path.split("[", 1)[0].split(".", 1)[0] or None)  # NOTE: the top-level field
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in pairs:
            if isinstance(key, str) and not _is_text(key):
                raise ApiError(
                    400,
                    f"a key in {path or 'the body'} holds a lone UTF-16 surrogate, which is not text",
                    param=path or None,
                    code="invalid_value",
                )
            if isinstance(item, str):
                if not _is_text(item):
                    where = _path(path, key)
                    raise ApiError(
                        400,
                        f"'{where}' holds a lone UTF-16 surrogate, which is not text",
                        param=where,
                        code="invalid_value",
                    )
            elif isinstance(item, BadNumber):
                where = _path(path, key)
                raise ApiError(400, f"'{where}' {item.why()}", param=where, code="invalid_value")
            elif isinstance(item, dict | list):
                stack.append((item, _path(path, key), depth + 1))


def _is_text(value: str) -> bool:
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key
