"""The OpenAI request parameters `kvscope serve` takes, checked as vLLM checks them, and those it refuses.

    params = parse_params(body, chat=False, vocab_size=512, eos_id=2)   # ParamError naming the field

NOTE: every top-level field of a request body is, for its endpoint, in exactly one of
    supported_names(chat)   it does what OpenAI (or vLLM, for its extensions) says, or the
                            request is a 400
    IGNORED                 accepted whatever its value, as vLLM accepts it: here it changes
                            nothing (no chat template, one queue, no special tokens, ...); the
                            front logs its name once
    refused_names(chat)     400 naming it, unless it has its neutral value (the one that asks
                            for nothing: null, [], false, ...): what would change the answer and
                            cannot be done here
    anything else           accepted and ignored, its name logged once, as vLLM (pydantic's
                            default) does
docs/serve.md's parameter table lists the same names; tests/server/test_openai_params.py keeps
the two equal.
NOTE: a stop string is matched on the generated token ids (the byte tokenizer's ids of its UTF-8
bytes), in the scheduler, so the request ends at the step that completes it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvscope.engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
COMPLETIONS_MAX_TOKENS = 16  # completions' default max_tokens, OpenAI's and vLLM's (chat's: the rest of the context)
MAX_TEMPERATURE = 2.0  # vLLM's (and OpenAI's) upper bound
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
MAX_PROMPTS = 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS default: prompts in one completions request
MAX_CHOICES = 16384  # n x prompts in one request (kvscope's own bound: vLLM has none on the product)
LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps a bias to [-100, 100]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_NUMBER_TEXT = 100  # NOTE: a longer numeric string is refused, not parsed

SHARED = (
    "model",
    "user",
    "stream",
    "stream_options",
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "truncate_prompt_tokens",
    "return_token_ids",
)
COMPLETIONS_ONLY = ("prompt", "echo", "logprobs")
# name -> why it changes nothing here (the front logs it with the name)
IGNORED: dict[str, str] = {
    "add_special_tokens": "the byte tokenizer adds no special tokens",
    "priority": "one queue, first come first served",
    "request_id": "the server names each request itself",
    "best_of": "not a field of vLLM 0.32, which ignores it too: n choices come back",
    "chat_template": "the server's chat rendering is fixed",
    "chat_template_kwargs": "the server's chat rendering is fixed",
    "add_generation_prompt": "the rendering always ends with the assistant's header",
    "reasoning_effort": "not a reasoning model",
    "parallel_tool_calls": "no tool is ever called",
    "tools": "no tool is ever called (tool_choice other than none is refused)",
    "functions": "no function is ever called (function_call other than none is refused)",
    "skip_special_tokens": "special ids never have text here",
    "spaces_between_special_tokens": "special ids never have text here",
    "store": "nothing is stored for OpenAI's dashboards",
    "metadata": "nothing is stored for OpenAI's dashboards",
    "service_tier": "one tier",
    "guided_json": "removed in vLLM, which ignores it too: the output is NOT constrained",
    "guided_regex": "removed in vLLM, which ignores it too: the output is NOT constrained",
    "guided_choice": "removed in vLLM, which ignores it too: the output is NOT constrained",
    "guided_grammar": "removed in vLLM, which ignores it too: the output is NOT constrained",
}
CHAT_ONLY = ("messages", "max_completion_tokens", "logprobs", "top_logprobs")
# name -> the neutral values a client may send without asking for the feature
REFUSED: dict[str, tuple[Any, ...]] = {
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "prompt_logprobs": (None,),
    "structured_outputs": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "continue_final_message": (None, False),
}
COMPLETIONS_REFUSED: dict[str, tuple[Any, ...]] = {"suffix": (None, "")}
CHAT_REFUSED: dict[str, tuple[Any, ...]] = {"echo": (None, False)}  # vLLM's chat echo repeats the last message


class ParamError(ValueError):
    """A parameter the server cannot honour: the message, the parameter and OpenAI's error code."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class RequestParams:
    """What one completions or chat request asks for, beyond its prompt."""

    n: int
    max_tokens: int | None  # None: the rest of the context (chat's default)
    max_key: str  # the field max_tokens came from, for errors
    truncate_prompt_tokens: int | None  # keep only the prompt's last k tokens (vLLM's); None: the whole prompt
    echo: bool
    num_logprobs: int | None  # None: no logprobs
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    sampling: SamplingParams
    ignored: tuple[str, ...] = ()  # fields accepted that change nothing here (IGNORED, or unknown)
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the reply


def parse_params(
    body: dict[str, Any], chat: bool, vocab_size: int, eos_id: int, encode: Callable[[str], list[int]]
) -> RequestParams:
    """The request's parameters, or ParamError naming the first bad one (`encode`: a stop string's ids).
    The prompt or messages, `model`, `user`, `stream` and `stream_options` are the front's."""
    ignored = check_names(body, chat)
    n = integer(body, "n", 1, low=1, high=MAX_N)
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = integer(body, max_key, None if chat else COMPLETIONS_MAX_TOKENS, low=1)
    stop = stop_strings(body.get("stop"))
    min_tokens = integer(body, "min_tokens", 0, low=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise ParamError(f"'min_tokens' ({min_tokens}) must be <= '{max_key}' ({max_tokens})", "min_tokens")
    num_logprobs = logprobs_of(body, chat)
    sampling = SamplingParams(
        temperature=number(body, "temperature", 0.0, low=0.0, high=MAX_TEMPERATURE),
        top_p=top_p(body),
        top_k=top_k(body, vocab_size),
        min_p=number(body, "min_p", 0.0, low=0.0, high=1.0),
        presence_penalty=number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=positive(body, "repetition_penalty", 1.0),
        seed=integer(body, "seed", None, low=INT64_MIN, high=INT64_MAX),
        logit_bias=logit_bias(body.get("logit_bias"), vocab_size),
        min_tokens=min_tokens,
        eos_id=eos_id,
        ignore_eos=boolean(body, "ignore_eos", False),
        stop_token_ids=token_ids(body.get("stop_token_ids"), vocab_size),
        stop_sequences=tuple(tuple(encode(s)) for s in stop),
        num_logprobs=num_logprobs,
    )
    return RequestParams(
        n,
        max_tokens,
        max_key,
        integer(body, "truncate_prompt_tokens", None, low=-1),
        False if chat else boolean(body, "echo", False),
        num_logprobs,
        stop,
        boolean(body, "include_stop_str_in_output", False),
        sampling,
        ignored,
        boolean(body, "return_token_ids", False),
    )


def ignored_names() -> tuple[str, ...]:
    return tuple(IGNORED)


def supported_names(chat: bool) -> tuple[str, ...]:
    return SHARED + (CHAT_ONLY if chat else COMPLETIONS_ONLY)


def refused_names(chat: bool) -> dict[str, tuple[Any, ...]]:
    return {**REFUSED, **(CHAT_REFUSED if chat else COMPLETIONS_REFUSED)}


def check_names(body: dict[str, Any], chat: bool) -> tuple[str, ...]:
    """The fields accepted that change nothing here (IGNORED ones, unknown ones); ParamError for a
    refused one that asks for something."""
    return tuple(check_fields(body, supported_names(chat), refused_names(chat)))


def check_fields(body: dict[str, Any], honoured: Collection[str], refused: Mapping[str, tuple[Any, ...]]) -> list[str]:
    """The names in `body` accepted that change nothing here (neither honoured nor refused); ParamError
    for a refused one whose value asks for something (not one of its neutral values)."""
    ignored = []
    for name, value in body.items():
        if name in honoured:
            continue
        if name not in refused:
            ignored.append(name)
            continue
        if not any(is_neutral(value, neutral) for neutral in refused[name]):
            raise ParamError(
                f"'{name}' is not supported by this server (kvscope serve); leave it out", name, "unsupported_parameter"
            )
    return ignored


def is_neutral(value: Any, neutral: Any) -> bool:
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(
    body: dict[str, Any], name: str, default: int | None, *, low: int | None = None, high: int | None = None
) -> Any:
    """The field as an int, read as vLLM's pydantic models read it: an integer, a whole float (5.0) or
    a string of one ("5", " 5 ", "5.0"); a boolean is refused (vLLM reads true as 1)."""
    value = as_integer(body.get(name))
    if value is None:
        return default
    if not is_int(value):
        raise ParamError(f"'{name}' must be an integer", name, "invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ParamError(f"'{name}' must be {bounds}, got {value}", name)
    return value


INTEGER_TEXT = re.compile(r"\s*[+-]?[0-9]+(?:_[0-9]+)*(?:\.0*)?\s*")


def as_integer(value: Any) -> Any:
    """`value` as an int when pydantic's lax mode takes it as one; anything else unchanged."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and INTEGER_TEXT.fullmatch(value) and len(value) <= MAX_NUMBER_TEXT:
        return int(value.strip().split(".")[0])
    return value


def number(body: dict[str, Any], name: str, default: float, *, low: float, high: float | None = None) -> float:
    """The field as a float: a number or, as vLLM's pydantic models read it, a string of one ("0.5")."""
    value = as_number(body.get(name))
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ParamError(f"'{name}' must be a number", name, "invalid_type")
    value = float(value)
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        bounds = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
        raise ParamError(f"'{name}' must be {bounds}, got {value:g}", name)
    return value


def as_number(value: Any) -> Any:
    if isinstance(value, str) and len(value) <= MAX_NUMBER_TEXT:
        try:
            return float(value)
        except ValueError:
            return value
    return value


def positive(body: dict[str, Any], name: str, default: float) -> float:
    value = number(body, name, default, low=0.0)
    if value <= 0:
        raise ParamError(f"'{name}' must be > 0, got {value:g}", name)
    return value


def boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ParamError(f"'{name}' must be a boolean", name, "invalid_type")
    return value


def top_p(body: dict[str, Any]) -> float:
    value = number(body, "top_p", 1.0, low=0.0, high=1.0)
    if value <= 0:
        raise ParamError(f"'top_p' must be in (0, 1], got {value:g}", "top_p")
    return value


def top_k(body: dict[str, Any], vocab_size: int) -> int:
    """-1 (every token) for -1, 0 and anything past the vocabulary, as vLLM's sampler reads them."""
    value: int = integer(body, "top_k", -1, low=-1)
    return -1 if value >= vocab_size else value


def stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ParamError("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if any(not s for s in items):
        raise ParamError("'stop' cannot contain an empty string", "stop")
    return tuple(items)


def token_ids(value: Any, vocab_size: int) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(is_int(i) for i in value):
        raise ParamError("'stop_token_ids' must be a list of token ids", "stop_token_ids", "invalid_type")
    bad = next((i for i in value if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ParamError(f"'stop_token_ids' has {bad}, outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    return tuple(value)


def logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """{token id (a string of digits, as JSON keys are): bias}, each bias clamped to [-100, 100] as vLLM does."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ParamError("'logit_bias' must be an object of token id -> bias", "logit_bias", "invalid_type")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ParamError(f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise ParamError(
                f"'logit_bias' has token id {token_id}, outside the vocabulary [0, {vocab_size})", "logit_bias"
            )
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias):
            raise ParamError(f"'logit_bias' value for {key!r} must be a number", "logit_bias", "invalid_type")
        out[token_id] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))
    return out


def logprobs_of(body: dict[str, Any], chat: bool) -> int | None:
    """How many top logprobs per token (0: only the chosen token's), or None for no logprobs."""
    name = "top_logprobs" if chat else "logprobs"
    if isinstance(body.get(name), str):  # NOTE: vLLM checks these two before its models would read "5" as 5
        raise ParamError(f"'{name}' must be an integer", name, "invalid_type")
    if not chat:
        value: int | None = integer(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
        return value
    wanted = boolean(body, "logprobs", False)
    top: int | None = integer(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
    if top and not wanted:
        raise ParamError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None
