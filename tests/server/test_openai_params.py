"""The OpenAI surface does what it accepts: sampling, stops, logprobs, echo, n and batches against a
real `kvscope serve`, with the official client; everything else is a 400 naming the parameter;
docs/serve.md's parameter table and the server agree row by row."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvscope.server.openai_params import ignored_names, refused_names, supported_names
from kvscope.workloads.tokenizer import EOS_ID, ByteTokenizer
from tests.server.serving import Server, serving

MODEL = "kvscope-tiny"
CONTEXT_LEN = 96  # small, so a reply without max_tokens runs to the end of the context quickly
DOC = Path(__file__).resolve().parents[2] / "docs" / "serve.md"
ENDPOINTS = {"completions": False, "chat": True}
X_ID = ByteTokenizer().encode("x").tolist()[0]
ALWAYS_X = {str(X_ID): 100}  # every token is "x" (greedy, or any draw: the bias dwarfs the rest)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    capture = tmp_path_factory.mktemp("openai") / "serve.db"
    with serving(capture, "--max-context-len", str(CONTEXT_LEN), "--level", "summary") as started:
        yield started
        code, printed = started.stop()
        assert code == 0, printed


def post(server: Server, chat: bool, body: dict[str, Any]) -> httpx.Response:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    base.update(body)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(server.url + path, json=base, timeout=60)


# -- the doc's table -----------------------------------------------------------------------------


def doc_table() -> dict[str, dict[str, str]]:
    """name -> {"completions": "yes" | "refused" | "—", "chat": ...} from docs/serve.md."""
    lines = DOC.read_text().split("<!-- params-table")[1].splitlines()[1:]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        names, completions, chat = (cell.strip() for cell in line.strip("|").split("|")[:3])
        for name in re.findall(r"`([^`]+)`", names):
            rows[name] = {"completions": completions, "chat": chat}
    return rows


def server_status(name: str, chat: bool) -> str:
    if name in supported_names(chat):
        return "yes"
    if name in ignored_names():
        return "ignored"
    return "refused" if name in refused_names(chat) else "—"


def test_the_doc_table_is_the_servers_list() -> None:
    table = doc_table()
    assert len(table) > 40
    for name, cells in table.items():
        for endpoint, chat in ENDPOINTS.items():
            assert cells[endpoint] == server_status(name, chat), (name, endpoint)
    for chat in ENDPOINTS.values():
        missing = (set(supported_names(chat)) | set(refused_names(chat)) | set(ignored_names())) - set(table)
        assert not missing, f"in the server, not in docs/serve.md's table: {sorted(missing)}"


# a request that uses each supported parameter (fields added to a small base request)
EXAMPLES: dict[str, dict[str, Any]] = {
    "model": {"model": MODEL},
    "prompt": {"prompt": [[70, 71], [72]]},
    "user": {"user": "someone"},
    "messages": {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "max_tokens": {"max_tokens": 3},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "n": {"n": 2},
    "temperature": {"temperature": 0.7},
    "top_p": {"top_p": 0.9},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.1},
    "seed": {"seed": 5, "temperature": 1.0},
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": -1.0},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "logit_bias": {"logit_bias": {"60": 5}},
    "stop": {"stop": ["zz", "q"]},
    "stop_token_ids": {"stop_token_ids": [7]},
    "include_stop_str_in_output": {"include_stop_str_in_output": True},
    "ignore_eos": {"ignore_eos": True},
    "min_tokens": {"min_tokens": 1},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "echo": {"echo": True},
    "truncate_prompt_tokens": {"truncate_prompt_tokens": 1},
    "return_token_ids": {"return_token_ids": True},
}


def example(name: str, chat: bool) -> dict[str, Any]:
    if name == "logprobs":
        return {"logprobs": True} if chat else {"logprobs": 2}
    return EXAMPLES[name]


def test_every_supported_parameter_is_accepted_and_every_refused_one_is_a_400_naming_it(server: Server) -> None:
    for name, cells in doc_table().items():
        for endpoint, chat in ENDPOINTS.items():
            if cells[endpoint] == "yes":
                reply = post(server, chat, example(name, chat))
                assert reply.status_code == 200, (endpoint, name, reply.text)
            elif cells[endpoint] == "ignored":  # NOTE: whatever it asks, as vLLM accepts it
                reply = post(server, chat, {name: {"asks-for": "something"}})
                assert reply.status_code == 200, (endpoint, name, reply.text)
            elif cells[endpoint] == "refused":
                reply = post(server, chat, {name: {"asks-for": "something"}})
                error = reply.json()["error"]
                assert (reply.status_code, error["param"], error["type"]) == (400, name, "invalid_request_error")
                assert error["code"] == "unsupported_parameter"
    unknown = post(server, False, {"frobnicate": 1})  # NOTE: as vLLM: an unknown field is ignored (and logged)
    assert unknown.status_code == 200, unknown.text
    neutral = post(
        server,
        True,
        {"tools": [{"type": "function"}], "tool_choice": "none", "response_format": {"type": "text"}, "echo": False},
    )
    assert neutral.status_code == 200, neutral.text
    asked = post(server, True, {"tools": [{"type": "function"}], "tool_choice": "auto"})
    assert (asked.status_code, asked.json()["error"]["param"]) == (400, "tool_choice")


def test_max_tokens_past_the_context_is_cut_and_truncate_prompt_tokens_keeps_the_prompts_tail(server: Server) -> None:
    long = post(server, False, {"prompt": "y" * 80, "max_tokens": CONTEXT_LEN - 1, "logit_bias": ALWAYS_X})
    assert long.status_code == 200, long.text
    choice, usage = long.json()["choices"][0], long.json()["usage"]
    assert (choice["finish_reason"], usage["prompt_tokens"] + usage["completion_tokens"]) == ("length", CONTEXT_LEN)
    cut = post(server, False, {"prompt": "abcdef", "truncate_prompt_tokens": 2, "echo": True, "max_tokens": 1})
    assert cut.status_code == 200, cut.text
    assert (cut.json()["usage"]["prompt_tokens"], cut.json()["choices"][0]["text"][:2]) == (2, "ef")
    past = post(server, False, {"prompt": "y", "max_tokens": CONTEXT_LEN + 1})  # NOTE: vLLM's 400: past the context
    assert (past.status_code, past.json()["error"]["param"]) == (400, "max_tokens")
    zero = post(server, True, {"truncate_prompt_tokens": 0})
    assert (zero.status_code, zero.json()["error"]["param"]) == (400, "truncate_prompt_tokens")


@pytest.mark.parametrize(
    ("chat", "body", "param"),
    [
        (False, {"temperature": -0.1}, "temperature"),
        (False, {"temperature": "hot"}, "temperature"),
        (False, {"top_p": 0}, "top_p"),
        (False, {"top_p": 1.01}, "top_p"),
        (False, {"top_k": -2}, "top_k"),
        (False, {"min_p": 1.5}, "min_p"),
        (False, {"n": 0}, "n"),
        (False, {"n": 16385}, "n"),
        (False, {"temperature": 2.5}, "temperature"),
        (False, {"stream_options": {"include_usage": True}}, "stream_options"),  # NOTE: without stream
        (False, {"prompt": ["ab", [70]]}, "prompt"),  # NOTE: strings and id lists mixed
        (False, {"max_tokens": 0}, "max_tokens"),
        (False, {"min_tokens": 3}, "min_tokens"),  # more than max_tokens (2)
        (False, {"presence_penalty": 2.5}, "presence_penalty"),
        (False, {"frequency_penalty": -2.5}, "frequency_penalty"),
        (False, {"repetition_penalty": 0}, "repetition_penalty"),
        (False, {"seed": 2**64}, "seed"),
        (False, {"seed": 1.5}, "seed"),
        (False, {"logprobs": 21}, "logprobs"),
        (False, {"logprobs": True}, "logprobs"),
        (False, {"stop": [""]}, "stop"),
        (False, {"stop": 5}, "stop"),
        (False, {"stop_token_ids": [-1]}, "stop_token_ids"),
        (False, {"logit_bias": {"100000": 1}}, "logit_bias"),
        (False, {"logit_bias": {"abc": 1}}, "logit_bias"),
        (False, {"ignore_eos": "yes"}, "ignore_eos"),
        (False, {"echo": 1}, "echo"),
        (True, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (True, {"echo": True}, "echo"),
        (True, {"max_completion_tokens": 0}, "max_completion_tokens"),
        (True, {"max_tokens": None, "messages": [{"role": "user", "content": "y" * CONTEXT_LEN}]}, "messages"),
    ],
)
def test_out_of_range_is_a_400_naming_the_parameter(
    server: Server, chat: bool, body: dict[str, Any], param: str
) -> None:
    reply = post(server, chat, body)
    assert reply.status_code == 400, reply.text
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert reply.json()["error"]["param"] == param


# -- what the accepted parameters do -------------------------------------------------------------


def test_sampling_is_reproducible_per_seed_and_default_is_greedy(server: Server) -> None:
    client = server.client()

    def text(**kwargs: Any) -> list[str]:
        reply = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, **kwargs)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    seeded = text(temperature=1.0, seed=11, n=2)
    assert text(temperature=1.0, seed=11, n=2) == seeded
    assert seeded[0] != seeded[1]  # choice i draws from seed + i
    assert text(temperature=1.0, seed=12) == [seeded[1]]
    assert text(temperature=1.0, seed=13) != [seeded[0]]
    assert text(temperature=1.0) != text(temperature=1.0)  # unseeded: fresh draws each time
    greedy = text()
    assert text(temperature=0) == greedy == text(temperature=1.0, extra_body={"top_k": 1})


def test_eos_stops_unless_ignore_eos_and_min_tokens_holds_it_off(server: Server) -> None:
    client = server.client()
    eos = {str(EOS_ID): 100}
    stopped = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, logit_bias=eos)
    assert (stopped.choices[0].finish_reason, stopped.choices[0].text) == ("stop", "")
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    ignored = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=8, logit_bias=eos, extra_body={"ignore_eos": True}
    )
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage is not None and ignored.usage.completion_tokens == 8
    held = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=8, logit_bias=eos, extra_body={"min_tokens": 3}
    )
    assert held.choices[0].finish_reason == "stop"
    assert held.usage is not None and held.usage.completion_tokens == 4


def test_max_tokens_defaults_to_16_on_completions_and_to_the_rest_of_the_context_on_chat(server: Server) -> None:
    chat = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}])
    assert chat.usage is not None and chat.usage.total_tokens == CONTEXT_LEN
    assert chat.choices[0].finish_reason == "length"
    for absent in ({}, {"max_tokens": None}):  # NOTE: vLLM 0.32 (and OpenAI): 16, an explicit null too
        body = {"model": MODEL, "prompt": "go", "ignore_eos": True, **absent}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert reply.json()["usage"]["completion_tokens"] == 16, reply.text


def test_stop_strings_and_stop_token_ids(server: Server) -> None:
    client = server.client()
    xs = {"logit_bias": ALWAYS_X, "max_tokens": 10}
    reply = client.completions.create(model=MODEL, prompt="hi", stop="xx", extra_body={"min_tokens": 3}, **xs)
    choice = reply.model_dump()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("x", "stop", "xx")
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    kept = client.completions.create(
        model=MODEL, prompt="hi", stop=["q", "xxx"], extra_body={"include_stop_str_in_output": True}, **xs
    )
    assert (kept.choices[0].text, kept.choices[0].finish_reason) == ("xxx", "stop")
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "s"}],
        stop="xxxx",
        extra_body={"min_tokens": 5},
        stream=True,
        **xs,
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "x"  # the stop string never shows
    assert chunks[-1].choices[0].finish_reason == "stop"
    by_id = client.completions.create(model=MODEL, prompt="hi", extra_body={"stop_token_ids": [X_ID]}, **xs)
    choice = by_id.model_dump()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("", "stop", X_ID)


def test_logprobs_and_echo(server: Server) -> None:
    client = server.client()
    prompt = [80, 90, 100, 110]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=3)
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 3 <= len(top) <= 4
        assert max(top, key=lambda t: top[t]) == token  # greedy: the chosen token is the most likely
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=1, echo=True)
    elp = echoed.choices[0].logprobs
    assert elp is not None and elp.token_logprobs is not None and elp.tokens is not None
    assert echoed.choices[0].text.startswith(ByteTokenizer().decode(prompt))
    assert len(elp.token_logprobs) == len(prompt) + 2 and elp.token_logprobs[0] is None
    # the raw logprob of an "x" forced by the bias, as an output (the paged path) and as a prompt
    # token (echo: the dense forward) is the same number
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=0, logit_bias=ALWAYS_X)
    again = client.completions.create(model=MODEL, prompt=[*prompt, X_ID], max_tokens=1, logprobs=0, echo=True)
    as_output, as_prompt = forced.choices[0].logprobs, again.choices[0].logprobs
    assert as_output is not None and as_output.token_logprobs is not None and as_output.tokens == ["x"]
    assert as_prompt is not None and as_prompt.token_logprobs is not None
    assert as_prompt.token_logprobs[len(prompt)] == pytest.approx(as_output.token_logprobs[0], abs=1e-4)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == 3
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


def test_return_token_ids_gives_the_prompts_and_each_choices_ids_streamed_and_not(server: Server) -> None:
    """vLLM's `return_token_ids`: completions' choices carry `prompt_token_ids` and `token_ids` (every id
    generated: as many as completion_tokens); chat's reply carries the prompt's ids; a stream's chunks carry
    each choice's new ids, which add up to the unstreamed reply's, and its first chunk the prompt's."""
    prompt = "abc"
    body = {"prompt": prompt, "max_tokens": 4, "n": 2, "ignore_eos": True, "seed": 3, "temperature": 1.0}
    whole = post(server, False, {**body, "return_token_ids": True}).json()
    prompt_ids = ByteTokenizer().encode(prompt).tolist()
    ids = {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [prompt_ids, prompt_ids]
    assert sum(map(len, ids.values())) == whole["usage"]["completion_tokens"] == 8
    assert all(ByteTokenizer().decode(ids[c["index"]]) == c["text"] for c in whole["choices"])
    plain = post(server, False, body).json()
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])
    streamed = post(server, False, {**body, "return_token_ids": True, "stream": True})
    chunks = [json.loads(e[6:]) for e in streamed.text.split("\n\n") if e.startswith("data: {")]
    got: dict[int, list[int]] = {}
    prompts: dict[int, int] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            got.setdefault(choice["index"], []).extend(choice["token_ids"])
            prompts[choice["index"]] = prompts.get(choice["index"], 0) + ("prompt_token_ids" in choice)
    assert (got, prompts) == (ids, {0: 1, 1: 1})
    echoed = post(server, False, {"prompt": prompt, "max_tokens": 2, "echo": True, "return_token_ids": True}).json()
    choice = echoed["choices"][0]
    assert choice["text"] == ByteTokenizer().decode(choice["token_ids"])  # vLLM's: the ids replace the echo
    chat = post(server, True, {"max_tokens": 3, "ignore_eos": True, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 3
    chat_stream = post(server, True, {"max_tokens": 3, "ignore_eos": True, "return_token_ids": True, "stream": True})
    chat_chunks = [json.loads(e[6:]) for e in chat_stream.text.split("\n\n") if e.startswith("data: {")]
    assert chat_chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert sum(len(c["choices"][0].get("token_ids", [])) for c in chat_chunks) == 3


def test_continuous_usage_stats_puts_each_choices_usage_so_far_on_every_chunk(server: Server) -> None:
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries its choice's usage so far, and the
    last chunk the whole reply's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "abc", "max_tokens": 4, "n": 2, "ignore_eos": True, "stream": True, "stream_options": options}
    reply = post(server, False, body)
    chunks = [json.loads(e[6:]) for e in reply.text.split("\n\n") if e.startswith("data: {")]
    assert chunks and all("usage" in c for c in chunks), reply.text
    seen: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == 3 and usage["total_tokens"] == 3 + usage["completion_tokens"]
        seen.setdefault(chunk["choices"][0]["index"], []).append(usage["completion_tokens"])
    assert {i: (c == sorted(c), c[-1]) for i, c in seen.items()} == {0: (True, 4), 1: (True, 4)}
    assert (chunks[-1]["choices"], chunks[-1]["usage"]["completion_tokens"]) == ([], 8)


def test_n_and_batched_prompts_streamed_and_not(server: Server) -> None:
    client = server.client()
    reply = client.completions.create(
        model=MODEL, prompt=["ab", "cde"], n=2, max_tokens=3, temperature=1.0, seed=1, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (2 + 3, 4 * 3)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "s"}],
        n=3,
        max_tokens=4,
        temperature=1.0,
        seed=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {}
    ends: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                ends[choice.index] = choice.finish_reason
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 12
    plain = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "s"}],
        n=3,
        max_tokens=4,
        temperature=1.0,
        seed=2,
        extra_body={"ignore_eos": True},
    )
    assert {c.index: c.message.content for c in plain.choices} == texts  # same seeds, same samples


def test_model_version_tokenize_routes(server: Server) -> None:
    assert httpx.get(f"{server.url}/v1/models/{MODEL}").json()["id"] == MODEL
    missing = httpx.get(f"{server.url}/v1/models/other")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")
    assert httpx.get(f"{server.url}/version").json()["version"]
    info = httpx.get(f"{server.url}/get_model_info").json()
    assert (info["model_path"], info["is_generation"]) == (MODEL, True)
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "hé"}).json()
    assert tokens == {"tokens": ByteTokenizer().encode("hé").tolist(), "count": 3, "max_model_len": CONTEXT_LEN}
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hé"}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**30]})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "tokens")
    assert json.loads(httpx.post(f"{server.url}/tokenize", json={"prompt": 5}).text)["error"]["param"] == "prompt"
