"""A fuzz test of `kvscope serve`'s HTTP front: a fixed, generated corpus of bad requests
(malformed JSON, deep nesting, huge integers, non-finite numbers, lone surrogates, wrong types,
clients that disconnect mid-body) against a real server on 127.0.0.1. No answer is a 500, every
4xx is OpenAI's error JSON (naming the field where the case knows it), the server prints no
traceback, and it still answers afterwards."""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server.serving import Server, serving

MODEL = "kvscope-tiny"
SEED = 25
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
WRONG_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    "x",
    "",
    [],
    {},
    [1],
    ["a", "b"],
    {"a": 1},
    [[1]],
    [None],
    10**30,
]
SURROGATES = ["\ud800", "\udfff", "a\ud83d", "\udc00b"]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    bad: bool = True  # must be a 4xx; otherwise a 200 is fine too
    param: str | None = "?"  # the error's expected param ("?": not checked)


def base(path: str) -> dict[str, Any]:
    if path == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def put(body: dict[str, Any], where: str, value: Any) -> dict[str, Any]:
    """`body` with `value` at a dotted path ("messages.0.content")."""
    keys = where.split(".")
    node: Any = body
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value
    return body


def dumps(body: Any) -> bytes:
    return json.dumps(body).encode()  # NOTE: ensure_ascii: a lone surrogate is sent as its \\u escape


def wrong_types() -> Iterator[Case]:
    fields = {
        COMPLETIONS: [
            "model",
            "prompt",
            "max_tokens",
            "stream",
            "stream_options",
            "user",
            "n",
            "stream_options.include_usage",
        ],
        CHAT: [
            "model",
            "messages",
            "messages.0",
            "messages.0.role",
            "messages.0.content",
            "max_tokens",
            "max_completion_tokens",
            "stream",
            "stream_options",
            "user",
        ],
    }
    for path, names in fields.items():
        for name in names:
            for value in WRONG_VALUES:
                yield Case(f"{path} {name}={value!r}", path, dumps(put(base(path), name, value)), bad=False)
        content = base(CHAT)
        for part in [{"type": "image_url"}, {"type": "text"}, {"type": "text", "text": 5}, "text", None, []]:
            yield Case(
                f"content part {part!r}",
                CHAT,
                dumps(put(content, "messages.0.content", [part])),
                param="messages[0].content",
            )
    yield Case(
        "stream_options []",
        COMPLETIONS,
        dumps({**base(COMPLETIONS), "stream": True, "stream_options": []}),
        param="stream_options",
    )


def surrogates() -> Iterator[Case]:
    spots = [
        (COMPLETIONS, "prompt", "prompt"),
        (COMPLETIONS, "user", "user"),
        (COMPLETIONS, "model", "model"),
        (COMPLETIONS, "extra", "extra"),
        (COMPLETIONS, "stream_options.x", "stream_options.x"),
        (CHAT, "messages.0.content", "messages[0].content"),
        (CHAT, "messages.0.role", "messages[0].role"),
        (CHAT, "user", "user"),
    ]
    for path, where, param in spots:
        for text in SURROGATES:
            for stream in (False, True):
                body = put(base(path), where, text)
                yield Case(f"surrogate {text!r} in {where}", path, dumps({**body, "stream": stream}), param=param)
    for text in SURROGATES:
        parts = [{"type": "text", "text": "ok"}, {"type": "text", "text": text}]
        yield Case(
            "surrogate in a text part",
            CHAT,
            dumps(put(base(CHAT), "messages.0.content", parts)),
            param="messages[0].content[1].text",
        )
        yield Case("surrogate in a key", COMPLETIONS, dumps({**base(COMPLETIONS), text: 1}), param=None)
        yield Case("a bare surrogate string", COMPLETIONS, dumps(text), param=None)


def nesting() -> Iterator[Case]:
    for depth in (65, 200, 999, 1000, 1001, 5000, 100_000):
        lists, dicts = b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth
        yield Case(f"a body nested {depth} deep", COMPLETIONS, lists, param=None)
        yield Case(f"objects nested {depth} deep", CHAT, dicts)
        for path, field in (
            (COMPLETIONS, "prompt"),
            (CHAT, "messages"),
            (COMPLETIONS, "stream_options"),
            (COMPLETIONS, "user"),
        ):
            body = dumps(base(path)).rstrip(b"}") + b', "' + field.encode() + b'_x": 0}'
            body = body.replace(b'"' + field.encode() + b'_x": 0', b'"' + field.encode() + b'": ' + lists)
            yield Case(f"{field} nested {depth} deep", path, body, param=field)


def numbers() -> Iterator[Case]:
    for digits in (4301, 5000, 50_000):
        huge = b"9" * digits
        for path, field in (
            (COMPLETIONS, "max_tokens"),
            (COMPLETIONS, "n"),
            (COMPLETIONS, "user"),
            (CHAT, "max_completion_tokens"),
            (COMPLETIONS, "stream_options.include_usage"),
        ):
            body = dumps(put(base(path), field, 7)).replace(b": 7", b": -" + huge if digits == 5000 else b": " + huge)
            yield Case(f"{field} of {digits} digits", path, body, param=field)
        body = dumps(base(COMPLETIONS)).replace(b'"hi"', b"[1, 2, " + huge + b"]")
        yield Case(f"a prompt token of {digits} digits", COMPLETIONS, body, param="prompt[2]")
        yield Case(f"a bare integer of {digits} digits", COMPLETIONS, huge, param=None)
    for constant in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"):
        body = dumps(put(base(COMPLETIONS), "max_tokens", 7)).replace(b": 7", b": " + constant)
        yield Case(f"max_tokens {constant!r}", COMPLETIONS, body, param="max_tokens")
        yield Case(
            f"a temperature of {constant!r}",
            CHAT,
            dumps(put(base(CHAT), "temperature", 7)).replace(b": 7", b": " + constant),
            param="temperature",
        )
    yield Case(  # NOTE: a whole number, so (as vLLM 0.32) a 400 for being past the context, not for its digits
        "4300 digits is an integer, past the context",
        COMPLETIONS,
        dumps(put(base(COMPLETIONS), "max_tokens", 7)).replace(b": 7", b": " + b"9" * 4300),
        param="max_tokens",
    )


def malformed(rng: random.Random) -> Iterator[Case]:
    good = dumps({**base(COMPLETIONS), "stream": True, "stream_options": {"include_usage": True}})
    for _ in range(40):
        cut = rng.randrange(0, len(good))
        yield Case(f"cut at {cut}", COMPLETIONS, good[:cut], param=None)
    for _ in range(30):
        yield Case("random bytes", rng.choice([COMPLETIONS, CHAT]), rng.randbytes(rng.randrange(1, 200)), param=None)
    for _ in range(20):
        body = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        yield Case("flipped bytes", COMPLETIONS, bytes(body), bad=False)
    for raw in (
        b"",
        b"null",
        b"[]",
        b"1",
        b'"text"',
        b"true",
        b"\xef\xbb\xbf{}",
        b'{"prompt": "hi",}',
        b"{'prompt': 'hi'}",
        b'{"prompt": "a\x01b"}',
        b'{"prompt": "\xff\xfe"}',
        b'{"prompt": "hi"} x',
        b'{"prompt": "\\x41"}',
        b'{"prompt": "\\ud800\\u"}',
    ):
        yield Case(f"malformed {raw[:30]!r}", rng.choice([COMPLETIONS, CHAT]), raw)


def corpus() -> list[Case]:
    rng = random.Random(SEED)
    return [*wrong_types(), *surrogates(), *nesting(), *numbers(), *malformed(rng)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("fuzz") / "serve.db") as srv:
        yield srv


def check_reply(case: Case, reply: httpx.Response) -> None:
    assert reply.status_code != 500, (case.name, reply.text[:300])
    if reply.status_code == 200 and not case.bad:
        return
    assert 400 <= reply.status_code < 500, (case.name, reply.status_code, reply.text[:300])
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, (case.name, error)
    assert isinstance(error["message"], str) and error["message"], case.name
    if case.param != "?":
        assert error["param"] == case.param, (case.name, error)


def disconnect_mid_body(url: str, rng: random.Random) -> None:
    """Send the headers and part of a body, then close the connection."""
    parts = urlsplit(url)
    body = dumps(base(CHAT))
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        chunked = rng.random() < 0.3
        framing = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body) + 100}".encode()
        sock.sendall(
            b"POST " + rng.choice([COMPLETIONS, CHAT]).encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n" + framing + b"\r\n\r\n"
        )
        sent = body[: rng.randrange(0, len(body))]
        sock.sendall(f"{len(body):x}\r\n".encode() + sent if chunked else sent)
        time.sleep(0.01)


def test_no_bad_request_is_a_500_or_a_traceback_and_the_server_survives(server: Server) -> None:
    cases = corpus()
    assert len(cases) > 500
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for case in cases:
            reply = http.post(case.path, content=case.body, headers={"content-type": "application/json"})
            check_reply(case, reply)
    rng = random.Random(SEED)
    for _ in range(30):
        disconnect_mid_body(server.url, rng)
    time.sleep(1.0)  # NOTE: the server has seen every disconnect before its output is read
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    good = server.client().completions.create(model=MODEL, prompt="still here", max_tokens=3)
    assert good.usage is not None and good.usage.completion_tokens == 3
    code, printed = server.stop()
    assert "Traceback" not in printed and "Exception in ASGI" not in printed, printed[-3000:]
    assert "internal error" not in printed, printed[-3000:]
    assert code == 0, printed[-3000:]


def test_the_corpus_is_fixed() -> None:
    assert [c.body for c in corpus()] == [c.body for c in corpus()]
