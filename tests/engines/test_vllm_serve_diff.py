"""The same request suite sent to `kvscope serve` and to a real vLLM 0.32 server (the session's one
server, tests/engines/conftest.py, which serves kvscope's byte tokenizer and chat template, so a
prompt is the same tokens on both) differs only where docs/serve.md's table of differences says,
and says why.

What is compared is what a client can rely on, never the generated text (the weights differ): the
HTTP status; a 4xx's `param` where vLLM names one; a reply's `object`, number of choices, finish
reasons, usage fields and prompt tokens, and whether it carries logprobs; a stream's framing (the
chunks' objects, a usage chunk, `[DONE]`). The keys of every reply, choice, usage, chunk and error
object are compared over the whole suite. The differences observed must equal the documented ones
exactly: a new difference fails, and so does one that went away.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engines.conftest import ROOT, InstrumentedVllm
from tests.engines.vllm_server import VLLM_PYTHON
from tests.server.serving import Server, serving

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"
    ),
]

DOC = ROOT / "docs" / "serve.md"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
CONTEXT_LEN = 256  # the shared vLLM server's --max-model-len
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any]  # without `model`, which is each server's own


def completions(name: str, **body: Any) -> Case:
    return Case(name, COMPLETIONS, {"prompt": "hello", "max_tokens": 3, "ignore_eos": True, **body})


def chat(name: str, **body: Any) -> Case:
    return Case(name, CHAT, {"messages": HI, "max_tokens": 3, "ignore_eos": True, **body})


# NOTE: EOS is ignored (random weights: where a reply ends would be chance) and stop strings are ones
# neither server is likely to draw, so the tokens generated are as many as asked; a field set to None
# is left out of the body
CASES = [
    completions("plain"),
    completions("token ids", prompt=[72, 73, 74, 75]),
    completions("a batch of prompts", prompt=["ab", [70, 71]]),
    completions("n 3, seeded", n=3, temperature=1.0, seed=7),
    completions("n 200", n=200, max_tokens=1),
    completions("best_of 2, n 1", best_of=2, n=1),
    completions("top_k above the vocabulary", top_k=100_000, temperature=1.0),
    completions("top_k -2", top_k=-2),
    completions("max_tokens as the string 5", max_tokens="5"),
    completions("max_tokens as the string 5.5", max_tokens="5.5"),
    completions("max_tokens true", max_tokens=True),
    completions("max_tokens 0", max_tokens=0),
    completions("max_tokens past what the prompt leaves", prompt="x" * 250, max_tokens=10),
    completions("max_tokens past the context", max_tokens=1000),
    completions("max_tokens absent", max_tokens=None),
    completions("a prompt longer than the context", prompt="x" * 300),
    completions("temperature 3", temperature=3.0),
    completions("temperature as a string", temperature="0.5"),
    completions("an unknown field", frobnicate=1),
    completions("add_special_tokens false", add_special_tokens=False),
    completions("priority 0", priority=0),
    completions("priority 1", priority=1),
    completions("request_id", request_id="client-chosen"),
    completions("truncate_prompt_tokens 2", truncate_prompt_tokens=2),
    completions("return_token_ids", return_token_ids=True),
    completions("return_token_ids with echo", return_token_ids=True, echo=True),
    completions("stream, return_token_ids", stream=True, return_token_ids=True),
    completions("prompt_logprobs 1", prompt_logprobs=1),
    completions("response_format json_object", response_format={"type": "json_object"}),
    completions("logprobs 2", logprobs=2),
    completions("logprobs 25", logprobs=25),
    completions("echo with logprobs", echo=True, logprobs=1),
    completions("stop strings", stop=["\u00e9\u00e9\u00e9", "zzzz"]),
    completions("min_tokens above max_tokens", min_tokens=5),
    completions("logit_bias", logit_bias={"60": 5}),
    completions("suffix", suffix="tail"),
    completions("use_beam_search", use_beam_search=True, n=2),
    completions("an unknown model", model="gpt-4"),
    completions("an empty prompt", prompt=""),
    completions("a token id past the vocabulary", prompt=[100_000]),
    completions("stream", stream=True),
    completions("stream, n 2, include_usage", stream=True, n=2, stream_options={"include_usage": True}),
    completions(
        "stream, continuous_usage_stats",
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ),
    completions("stream_options without stream", stream_options={"include_usage": True}),
    completions("stream as the string yes", stream="yes"),
    chat("plain"),
    chat("max_completion_tokens", max_tokens=None, max_completion_tokens=2),
    chat("n 2", n=2, temperature=1.0),
    chat(
        "a system message and a text part",
        messages=[
            {"role": "system", "content": "be terse"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
    ),
    chat("chat_template_kwargs", chat_template_kwargs={"enable_thinking": False}),
    chat("reasoning_effort", reasoning_effort="low"),
    chat("parallel_tool_calls false", parallel_tool_calls=False),
    chat("tools with tool_choice none", tools=[TOOL], tool_choice="none"),
    chat("tools with tool_choice auto", tools=[TOOL], tool_choice="auto"),
    chat("response_format json_object", response_format={"type": "json_object"}),
    chat("echo", echo=True),
    chat("logprobs with top_logprobs 2", logprobs=True, top_logprobs=2),
    chat("top_logprobs 0 without logprobs", top_logprobs=0),
    chat("top_logprobs 2 without logprobs", top_logprobs=2),
    chat("prompt_logprobs 1", prompt_logprobs=1),
    chat("return_token_ids", return_token_ids=True),
    chat("stream, return_token_ids", stream=True, return_token_ids=True),
    chat("continue_final_message", messages=[*HI, {"role": "assistant", "content": "he"}], continue_final_message=True),
    chat("an unknown field", frobnicate=1),
    chat("max_tokens beyond the context", max_tokens=1000),
    chat("a role it does not know", messages=[{"role": "wizard", "content": "x"}]),
    chat("no messages", messages=None),
    chat("stream with include_usage", stream=True, stream_options={"include_usage": True}),
    chat("stream_options without stream", stream_options={"include_usage": True}),
    Case("an unknown path", "/v1/no_such_endpoint", {"prompt": "hello"}),
]


@pytest.fixture(scope="module")
def kvscope_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    capture = tmp_path_factory.mktemp("serve-diff") / "serve.db"
    with serving(capture, "--max-context-len", str(CONTEXT_LEN), "--level", "summary") as server:
        yield server
        code, printed = server.stop()
        assert code == 0, printed[-3000:]


def model_of(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])


def send(url: str, model: str, case: Case) -> httpx.Response:
    body = {"model": model, **case.body}
    return httpx.post(url + case.path, json={k: v for k, v in body.items() if v is not None}, timeout=300)


def contract(reply: httpx.Response) -> tuple[dict[str, str], dict[str, set[str]]]:
    """What a client can rely on in `reply` (aspect -> value), and the names seen in it that are compared
    over the whole suite (where -> names: the keys of each object, the error types)."""
    keys: dict[str, set[str]] = {}
    if reply.status_code != 200:
        body = reply.json()
        error = body.get("error", {})
        keys["error keys"] = set(error)
        keys["error types"] = {
            str(error["type"]) if "error" in body else f"no error object ({', '.join(sorted(body))})"
        }
        return {"status": str(reply.status_code), "param": field_path(error.get("param"))}, keys
    if reply.headers["content-type"].startswith("text/event-stream"):
        return stream_contract(reply.text, keys), keys
    body = reply.json()
    keys["reply keys"] = set(body)
    choices = body["choices"]
    for choice in choices:
        keys.setdefault("choice keys", set()).update(choice)
        if "message" in choice:
            keys.setdefault("message keys", set()).update(k for k, v in choice["message"].items() if v is not None)
    usage = body.get("usage") or {}
    keys["usage keys"] = set(usage)
    return {
        "status": "200",
        "object": body["object"],
        "choices": str(len(choices)),
        "finish_reason": ",".join(sorted({str(c["finish_reason"]) for c in choices})),
        "prompt_tokens": str(usage.get("prompt_tokens")),
        "completion_tokens": str(usage.get("completion_tokens")),
        "logprobs": ",".join(sorted({"yes" if c.get("logprobs") else "no" for c in choices})),
        **token_ids_contract(body, usage),
    }, keys


def token_ids_contract(body: dict[str, Any], usage: dict[str, Any]) -> dict[str, str]:
    """return_token_ids: the prompt's ids (both servers tokenize alike) and whether the choices' ids are
    as many as the completion tokens; nothing when the reply carries none."""
    choices = body["choices"]
    prompts = [body.get("prompt_token_ids")] + [c.get("prompt_token_ids") for c in choices]
    ids = [c.get("token_ids") for c in choices]
    if all(p is None for p in prompts) and all(i is None for i in ids):
        return {}
    counted = sum(len(i or []) for i in ids) == usage.get("completion_tokens")
    return {
        "prompt_token_ids": json.dumps(next(p for p in prompts if p is not None), separators=(",", ":"))
        if any(p is not None for p in prompts)
        else "none",
        "token_ids": "as many as completion_tokens" if all(i is not None for i in ids) and counted else "not",
    }


def field_path(param: Any) -> str:
    """An error's param as a field path: vLLM's pydantic locations ("body.prompt.0") as kvscope's ("prompt[0]")."""
    if not isinstance(param, str):
        return str(param)
    path = param.removeprefix("body.")
    return re.sub(r"\.(\d+)", r"[\1]", path)


def stream_contract(text: str, keys: dict[str, set[str]]) -> dict[str, str]:
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    for chunk in chunks:
        keys.setdefault("chunk keys", set()).update(chunk)
        for choice in chunk["choices"]:
            keys.setdefault("chunk choice keys", set()).update(choice)
    finishes = {str(c["finish_reason"]) for ch in chunks for c in ch["choices"] if c.get("finish_reason")}
    return {
        "status": "200",
        "stream": "ends with [DONE]" if events[-1:] == ["[DONE]"] and events.count("[DONE]") == 1 else "no [DONE]",
        "object": ",".join(sorted({c["object"] for c in chunks})),
        "choices": str(len({c["index"] for ch in chunks for c in ch["choices"]})),
        "finish_reason": ",".join(sorted(finishes)),
        "usage": stream_usage(chunks),
    }


def stream_usage(chunks: list[dict[str, Any]]) -> str:
    with_usage = [c for c in chunks if c.get("usage")]
    if not with_usage:
        return "none"
    if len(with_usage) == len(chunks):
        return "every chunk"
    last_only = with_usage == chunks[-1:] and not chunks[-1]["choices"]
    return "a last chunk without choices" if last_only else f"{len(with_usage)} of {len(chunks)} chunks"


def differences(vllm: InstrumentedVllm, kvscope: Server) -> set[tuple[str, str, str, str]]:
    """(case, aspect, vLLM's, kvscope's) for every aspect that differs; key sets as case `every reply`."""
    servers = {"vllm": (vllm.server.url, model_of(vllm.server.url)), "kvscope": (kvscope.url, model_of(kvscope.url))}
    found: set[tuple[str, str, str, str]] = set()
    all_keys: dict[str, dict[str, set[str]]] = {"vllm": {}, "kvscope": {}}
    for case in CASES:
        seen: dict[str, dict[str, str]] = {}
        for name, (url, model) in servers.items():
            aspects, keys = contract(send(url, model, case))
            seen[name] = aspects
            for where, names in keys.items():
                all_keys[name].setdefault(where, set()).update(names)
        ours, theirs = seen["kvscope"], seen["vllm"]
        if ours["status"] != theirs["status"]:  # NOTE: the rest of the reply follows from it
            found.add((f"{case.path} {case.name}", "status", theirs["status"], ours["status"]))
            continue
        for aspect in sorted(set(ours) | set(theirs)):
            if aspect == "param" and theirs.get(aspect) == "None":
                continue  # NOTE: vLLM names no parameter: kvscope naming one is no difference a client sees
            if ours.get(aspect) != theirs.get(aspect):
                found.add((f"{case.path} {case.name}", aspect, theirs.get(aspect, "—"), ours.get(aspect, "—")))
    for where in sorted(set(all_keys["vllm"]) | set(all_keys["kvscope"])):
        only_vllm = all_keys["vllm"].get(where, set()) - all_keys["kvscope"].get(where, set())
        only_ours = all_keys["kvscope"].get(where, set()) - all_keys["vllm"].get(where, set())
        if only_vllm or only_ours:
            found.add(("every reply", where, ", ".join(sorted(only_vllm)) or "—", ", ".join(sorted(only_ours)) or "—"))
    return found


def documented() -> set[tuple[str, str, str, str]]:
    """docs/serve.md's table of differences: (case, aspect, vLLM's, kvscope's) per row."""
    lines = DOC.read_text().split("<!-- vllm-diff-table")[1].splitlines()[1:]
    rows = set()
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [re.sub(r"`", "", cell.strip()) for cell in line.strip().strip("|").split("|")]
        rows.add((cells[0], cells[1], cells[2], cells[3]))
    return rows


def test_kvscope_serve_differs_from_vllm_only_where_docs_serve_md_says_why(
    instrumented_vllm: InstrumentedVllm, kvscope_server: Server
) -> None:
    observed, doc = differences(instrumented_vllm, kvscope_server), documented()
    new = "\n".join(" | ".join(row) for row in sorted(observed - doc))
    gone = "\n".join(" | ".join(row) for row in sorted(doc - observed))
    assert observed == doc, f"not in docs/serve.md:\n{new}\ndocumented but not seen:\n{gone}"
