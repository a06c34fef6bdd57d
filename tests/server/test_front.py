"""The front's pieces on their own: principals, the keys file, the chat template, incremental
detokenization, request validation and the /metrics registry. (The served path end to end is
test_serve_e2e.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine import EngineConfig, PoolConfig, model_config
from kvscope.server.api_keys import Principal, load_api_keys, resolve_principal
from kvscope.server.body import decode_json
from kvscope.server.chat import ChatError, render_chat
from kvscope.server.choice import Detokenizer
from kvscope.server.errors import ApiError
from kvscope.server.front import Front, FrontState
from kvscope.server.metrics import COUNTERS, GAUGES, HISTOGRAMS, ServerMetrics
from kvscope.server.protocol import PoolStats, StatsOut
from kvscope.telemetry import tenant_of
from kvscope.workloads.tokenizer import ByteTokenizer

KEYS = {"k1": Principal("acme", "alice")}


def test_principal_without_keys_is_the_user() -> None:
    assert resolve_principal(None, None, "carol") == "carol"
    assert resolve_principal(None, "Bearer whatever", None) is None


@pytest.mark.parametrize(
    ("user", "principal"),
    [
        (None, "acme/alice"),
        ("acme/alice", "acme/alice"),
        ("sub", "acme/alice/sub"),
        ("acme/alice/sub", "acme/alice/sub"),
        ("acme/alice/a/b", "acme/alice/a/b"),
    ],
)
def test_a_user_only_narrows_the_keys_principal(user: str | None, principal: str) -> None:
    assert resolve_principal(KEYS, "Bearer k1", user) == principal


@pytest.mark.parametrize("user", ["beta/bob", "acme/mallory", "acme/alice2", "acme/alice/", "/acme/alice"])
def test_another_tenant_or_user_is_403(user: str) -> None:
    with pytest.raises(ApiError) as err:
        resolve_principal(KEYS, "Bearer k1", user)
    assert err.value.status == 403 and err.value.param == "user"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer k2", "Basic k1", "k1"])
def test_missing_or_wrong_key_is_401(header: str | None) -> None:
    with pytest.raises(ApiError) as err:
        resolve_principal(KEYS, header, None)
    assert err.value.status == 401 and err.value.code == "invalid_api_key"


def test_keys_file(tmp_path: Path) -> None:
    good = tmp_path / "keys.json"
    good.write_text(json.dumps({"k1": {"tenant": "acme", "user": "alice"}}))
    assert load_api_keys(good) == KEYS
    for bad in ("{", "[]", "{}", '{"k": 1}', '{"k": {"tenant": "a/b", "user": "u"}}', '{"k": {"tenant": "a"}}'):
        good.write_text(bad)
        with pytest.raises(ValueError, match="--api-keys"):
            load_api_keys(good)


def test_principals_are_a_canonical_encoding_no_two_keys_collide(tmp_path: Path) -> None:
    """T7: ("a", "b:c") and ("a:b", "c") are two principals, and stay two through every narrowing;
    the separator cannot occur in a name, so ("a", "b/c") and ("a/b", "c") cannot both exist."""
    keys = {"k1": Principal("a", "b:c"), "k2": Principal("a:b", "c")}
    names = {resolve_principal(keys, f"Bearer {k}", user) for k in keys for user in (None, "x")}
    assert len(names) == 4 and names == {"a/b:c", "a:b/c", "a/b:c/x", "a:b/c/x"}
    assert tenant_of("a/b:c") == "a" and tenant_of("a:b/c") == "a:b"  # the dashboard's tenants differ too
    path = tmp_path / "keys.json"
    for tenant, user in (("a", "b/c"), ("a/b", "c")):
        path.write_text(json.dumps({"k": {"tenant": tenant, "user": user}}))
        with pytest.raises(ValueError, match="without '/'"):
            load_api_keys(path)
    path.write_text(json.dumps({"k1": {"tenant": "a", "user": "b:c"}, "k2": {"tenant": "a:b", "user": "c"}}))
    assert load_api_keys(path) == keys  # control: the colon names are fine


def test_chat_template_is_deterministic_and_prefix_stable() -> None:
    one = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    two = [
        *one,
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
    ]
    assert render_chat(one) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert render_chat(one) == render_chat(json.loads(json.dumps(one)))
    assert render_chat(two).startswith(render_chat(one)[: -len("<|assistant|>\n")])
    assert render_chat([{"role": "wizard", "content": "x"}]) == "<|wizard|>\nx\n<|assistant|>\n"  # NOTE: as vLLM
    for bad, param in (
        (None, "messages"),
        ([], "messages"),
        ([{"role": 5}], "messages[0].role"),
        ([{"content": "no role"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
    ):
        with pytest.raises(ChatError) as err:
            render_chat(bad)
        assert err.value.param == param


def test_detokenizer_streams_what_decode_gives() -> None:
    tok = ByteTokenizer()
    ids = [*tok.encode("naïve → ok").tolist(), 2, 400, *tok.encode("é").tolist()]
    detok = Detokenizer()
    pieces = [detok.feed([i], final=n == len(ids) - 1) for n, i in enumerate(ids)]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces[:3])  # a split UTF-8 character waits for its bytes


@pytest.fixture
def front() -> Iterator[Front]:
    engine = EngineConfig(pool=PoolConfig(kv_size_tokens=256, max_context_len=128))
    state = FrontState(engine=engine, model=model_config("tiny"), model_id="kvscope-tiny", api_keys=KEYS)
    made = Front(state, "ipc:///tmp/kvscope-test-front-in", "ipc:///tmp/kvscope-test-front-out")
    try:
        yield made
    finally:
        for link in made.links:
            link.push.close()
            link.pull.close()
        made.context.term()


def test_parse_accepts_what_vllm_accepts_and_cuts_max_tokens_to_the_context(front: Front) -> None:
    """An unknown field and a no-op one are taken (their names kept for the log), and max_tokens past the
    context is cut to what the prompt leaves (vLLM 0.32's answer: 200, finish 'length')."""
    body = {"prompt": "x" * 120, "max_tokens": 9, "no_such_option": 1, "priority": 3}
    parsed = front.parse(body, False, "Bearer k1", 0.0)
    assert parsed.max_tokens == [8] and parsed.params.ignored == ("no_such_option", "priority")


@pytest.mark.parametrize(
    ("body", "what"),
    [
        ({"top_k": 10**6, "temperature": 1.0}, ("top_k", -1)),  # NOTE: vLLM's sampler: every token
        ({"top_k": 512, "temperature": 1.0}, ("top_k", -1)),
        ({"top_k": 511, "temperature": 1.0}, ("top_k", 511)),
        ({"n": 200, "max_tokens": 1}, ("n", 200)),  # NOTE: vLLM takes n up to 16384
        ({"max_tokens": "5"}, ("max_tokens", [5])),  # NOTE: pydantic's lax mode reads the string
        ({"max_tokens": " 5 "}, ("max_tokens", [5])),
        ({"max_tokens": 5.0}, ("max_tokens", [5])),
        ({"max_tokens": "5.0", "temperature": "0.5"}, ("temperature", 0.5)),
        ({"best_of": 2, "n": 1}, ("n", 1)),  # NOTE: not a field of vLLM 0.32: ignored
        ({"best_of": 2, "n": 1}, ("ignored", ("best_of",))),
    ],
)
def test_parse_takes_the_values_vllm_0_32_takes(
    front: Front, body: dict[str, object], what: tuple[str, object]
) -> None:
    """The values issue 40 found refused here and taken by vLLM 0.32 (seen on a real server too:
    tests/engines/test_vllm_serve_diff.py)."""
    parsed = front.parse({"prompt": "hi", **body}, False, "Bearer k1", 0.0)
    got = {
        "top_k": parsed.params.sampling.top_k,
        "temperature": parsed.params.sampling.temperature,
        "n": parsed.params.n,
        "max_tokens": parsed.max_tokens,
        "ignored": parsed.params.ignored,
    }
    assert got[what[0]] == what[1]


def test_parse_refuses_what_vllm_0_32_refuses(front: Front) -> None:
    """The limits behind those values: n past vLLM's 16384, a batch past its 1024 prompts, a string
    that is no whole number, and the logprobs counts vLLM checks before reading strings."""
    for body, param in [
        ({"n": 16385}, "n"),
        ({"prompt": ["a"] * 1025}, "prompt"),
        ({"max_tokens": "5.5"}, "max_tokens"),
        ({"max_tokens": "five"}, "max_tokens"),
        ({"logprobs": "2"}, "logprobs"),
    ]:
        with pytest.raises(ApiError) as err:
            front.parse({"prompt": "hi", **body}, False, "Bearer k1", 0.0)
        assert (err.value.status, err.value.param) == (400, param), body
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": "2"}
    with pytest.raises(ApiError) as err:
        front.parse(chat, True, "Bearer k1", 0.0)
    assert err.value.param == "top_logprobs"


def test_top_logprobs_0_without_logprobs_is_taken_as_vllm_takes_it(front: Front) -> None:
    chat = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0}
    assert front.parse(chat, True, "Bearer k1", 0.0).params.num_logprobs is None


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ([], 400, None),
        ({"prompt": "hi"}, 401, None),
        ({"prompt": "hi", "model": "other", "auth": True}, 404, "model"),
        ({"prompt": "", "auth": True}, 400, "prompt"),
        ({"prompt": [[1], []], "auth": True}, 400, "prompt"),
        ({"prompt": [True], "auth": True}, 400, "prompt"),
        ({"prompt": "x" * 128, "max_tokens": 9, "auth": True}, 400, "prompt"),  # NOTE: leaves no room
        ({"prompt": "hi", "max_tokens": True, "auth": True}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1, "auth": True}, 400, "max_tokens"),
        ({"prompt": "hi", "n": 0, "auth": True}, 400, "n"),
        ({"prompt": "hi", "temperature": -0.5, "auth": True}, 400, "temperature"),
        ({"prompt": "hi", "tools": [{"type": "function"}], "tool_choice": "auto", "auth": True}, 400, "tool_choice"),
        ({"prompt": "hi", "stream_options": 1, "auth": True}, 400, "stream_options"),
    ],
)
def test_parse_rejects_with_the_field(front: Front, body: object, status: int, param: str | None) -> None:
    if isinstance(body, dict):
        body = dict(body)  # the parameter is shared between runs
    auth = "Bearer k1" if isinstance(body, dict) and body.pop("auth", False) else None
    with pytest.raises(ApiError) as err:
        front.parse(body, False, auth, 0.0)
    assert (err.value.status, err.value.param) == (status, param)
    assert set(json.loads(bytes(err.value.response().body))["error"]) == {"message", "type", "param", "code"}


def test_parse_a_good_request(front: Front) -> None:
    req = front.parse(
        {"prompt": ["hi"], "max_tokens": 3, "user": "sub", "stream": True, "stream_options": {"include_usage": True}},
        False,
        "Bearer k1",
        1.5,
    )
    assert req.prompts == [ByteTokenizer().encode("hi").tolist()]
    assert (req.max_tokens, req.stream, req.include_usage, req.principal) == ([3], True, True, "acme/alice/sub")
    chat = front.parse(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2}, True, "Bearer k1", 0.0
    )
    assert chat.max_tokens == [2] and chat.chat


def test_metrics_render_every_documented_name() -> None:
    metrics = ServerMetrics(page_size=4, model_name="m")
    pool = PoolStats(total=100, used=10, available=80, evictable=10, protected=5)
    metrics.update(
        StatsOut(
            step=3,
            pools={"full": pool, "swa": pool},
            num_running=1,
            num_waiting=2,
            prompt_tokens=50,
            cached_tokens=20,
            generated_tokens=7,
            evicted_tokens=4,
            num_retractions=1,
            leak_checks_passed=2,
            leak_checks_failed=0,
        )
    )
    metrics.request_finished("length")
    metrics.latency(0).ttft.observe(0.01)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    names = {f.name for f in families.values()}
    for name in (*GAUGES, *HISTOGRAMS):
        assert name in names, name
    for name in COUNTERS:
        assert name.removesuffix("_total") in names, name
    identity = {"model_name": "m", "engine_type": "unified"}
    samples = {s.name: s.value for f in families.values() for s in f.samples if s.labels == identity}
    assert samples["sglang:prompt_tokens_total"] == 50 and samples["sglang:num_queue_reqs"] == 2
    assert samples["sglang:max_total_num_tokens_swa"] == 100


@pytest.mark.parametrize(
    ("options", "param"),
    [([], "stream_options"), ("", "stream_options"), ({"include_usage": "yes"}, "stream_options.include_usage")],
)
def test_stream_options_must_be_an_object_with_a_boolean(front: Front, options: object, param: str) -> None:
    with pytest.raises(ApiError) as err:
        front.parse({"prompt": "hi", "stream": True, "stream_options": options}, False, "Bearer k1", 0.0)
    assert (err.value.status, err.value.param) == (400, param)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "\\ud800"}', "prompt"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
            "messages[0].content[0].text",
        ),
        (b'{"max_tokens": ' + b"9" * 4301 + b"}", "max_tokens"),
        (b'{"temperature": NaN}', "temperature"),
        (b'{"top_p": 1e999}', "top_p"),
        (b'{"stream_options": ' + b"[" * 100 + b"]" * 100 + b"}", "stream_options"),
        (b"[" * 100_000, None),
        (b'{"prompt": "a\\"[", "messages": ' + b"[" * 100_000, "messages"),
    ],
)
def test_a_body_no_handler_can_trust_is_a_400_naming_its_field(raw: bytes, param: str | None) -> None:
    with pytest.raises(ApiError) as err:
        decode_json(raw)
    assert (err.value.status, err.value.param) == (400, param)
    json.loads(bytes(err.value.response().body))  # the error itself is valid JSON


def test_text_numbers_and_nesting_within_the_limits_decode() -> None:
    body = {"prompt": "naïve 😀", "max_tokens": 10**40, "messages": [[[{"a": 1.5}]]]}
    assert decode_json(json.dumps(body).encode()) == body
