"""SGLang's native `/generate` (SGLang 0.5.23's GenerateReqInput and its reply), checked and shaped here.

    req = parse_generate(body, vocab_size=512, eos_id=2, encode=...)   # ParamError naming the field
    reply(req, choice, outcome, rid, latency_s)                         # {"text", "output_ids", "meta_info"}

NOTE: every top-level field of a /generate body is one of
    NATIVE_FIELDS     honoured: text or input_ids (one prompt), sampling_params, stream, rid
    NATIVE_IGNORED    accepted whatever its value: here it changes nothing (the front logs it once)
    NATIVE_REFUSED    400 unless it carries a neutral value: it would change the answer (logprobs,
                      LoRA, images, hidden states, a disaggregated prefill ...), which this server
                      cannot give
    anything else     accepted and ignored, its name logged once, as SGLang ignores unknown keys
and every key of `sampling_params` is honoured (SAMPLING_FIELDS), ignored (SAMPLING_IGNORED),
refused unless neutral (SAMPLING_REFUSED), or unknown: a 400, as SGLang refuses it.
NOTE: SGLang's meanings, where they differ from the OpenAI routes'
    temperature       default 1.0 (sampled); below 1e-6 greedy
    top_k             default and -1: every token; above the vocabulary: every token; 0 is a 400
    max_new_tokens    default 128; null: the rest of the context; prompt + it past the context: 400
                      (SGLang does not cut it)
    no_stop_trim      keep the stop string or stop token in the text (the OpenAI routes'
                      include_stop_str_in_output)
    finish_reason     {"type": "length", "length": max_new_tokens}, {"type": "stop", "matched":
                      the stop string, or the stop token id (EOS: 2)}, {"type": "abort", "message"}
    stream            one `data: {...}` event per scheduler step, each with the text and
                      output_ids so far (SGLang's default, non-incremental), then `data: [DONE]`
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvscope.engine.sampling_params import SamplingParams
from kvscope.server.openai_params import (
    INT64_MAX,
    INT64_MIN,
    ParamError,
    RequestParams,
    boolean,
    check_fields,
    integer,
    is_int,
    number,
    stop_strings,
    token_ids,
)

SGLANG_VERSION = "0.5.23"  # the release whose request and reply shapes /generate follows
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
SGLANG_GREEDY_EPS = 1e-6  # SGLang: a lower temperature is greedy (top_k 1)
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # SGLang's rid prefix for /health_generate's request

NATIVE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "rid")
NATIVE_IGNORED: dict[str, str] = {
    "log_metrics": "every request counts in /metrics here",
    "priority": "one queue, first come first served",
    "logprob_start_len": "logprobs are not returned (return_logprob is refused)",
    "top_logprobs_num": "logprobs are not returned (return_logprob is refused)",
    "token_ids_logprob": "logprobs are not returned (return_logprob is refused)",
    "return_text_in_logprobs": "logprobs are not returned (return_logprob is refused)",
    "custom_labels": "no per-request metric labels",
    "routing_key": "no routing-key schedule policy",
    "session_id": "no sessions: each request stands alone",
    "conversation_id": "no request tracking beyond the capture",
    "video_config": "no video input",
    "use_audio_in_video": "no video input",
}
NATIVE_REFUSED: dict[str, tuple[Any, ...]] = {
    "return_logprob": (None, False),
    "return_hidden_states": (None, False),
    "return_routed_experts": (None, False),
    "return_indexer_topk": (None, False),
    "return_sampling_mask": (None, False),
    "return_prompt_token_ids": (None, False),
    "return_flat_raw_top_logprobs": (None, False),
    "return_flat_raw_output_top_logprobs": (None, False),
    "return_flat_raw_top_logprobs_b64": (None, False),
    "input_embeds": (None,),
    "image_data": (None, []),
    "video_data": (None, []),
    "audio_data": (None, []),
    "mm_hashes": (None,),
    "modalities": (None, []),
    "lora_path": (None,),
    "lora_id": (None,),
    "custom_logit_processor": (None,),
    "positional_embed_overrides": (None,),
    "session_params": (None,),
    "bootstrap_host": (None,),
    "bootstrap_port": (None,),
    "bootstrap_room": (None,),
    "bootstrap_pair_key": (None,),
    "decode_tp_size": (None,),
    "routed_dp_rank": (None,),
    "data_parallel_rank": (None,),
    "disagg_prefill_dp_rank": (None,),
    "background": (None, False),
    "require_reasoning": (None, False),
    "max_thinking_tokens": (None,),
    "extra_key": (None,),
    "cache_salt": (None,),
    "kv_hints": (None,),
    "watermark": (None,),
}
SAMPLING_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "no_stop_trim",
    "logit_bias",
    "sampling_seed",
)
SAMPLING_IGNORED: dict[str, str] = {
    "skip_special_tokens": "special ids never have text here",
    "spaces_between_special_tokens": "special ids never have text here",
    "stream_interval": "a stream sends every step's tokens",
    "custom_params": "no custom logit processor (custom_logit_processor is refused)",
}
SAMPLING_REFUSED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "repetition_penalty": (None, 1, 1.0),  # NOTE: SGLang's is on the output only; kvscope's engine's on the prompt too
    "json_schema": (None, ""),
    "regex": (None, ""),
    "ebnf": (None, ""),
    "structural_tag": (None, ""),
    "stop_regex": (None, "", []),
    "beam_width": (None,),
    "watermark": (None,),
    "choice": (None, []),
}


@dataclass(frozen=True)
class NativeRequest:
    """One /generate request: its prompt, its output budget (None: the rest of the context) and
    the parameters the OpenAI routes' machinery (Choice, the scheduler) reads."""

    input_ids: list[int]
    max_new_tokens: int | None
    stream: bool
    rid: str | None
    params: RequestParams

    @property
    def ignored(self) -> tuple[str, ...]:
        return self.params.ignored


def ignored_why(name: str) -> str:
    """Why a field the front logs as ignored changes nothing (`sampling_params.x` for a sampling one)."""
    bare = name.removeprefix("sampling_params.")
    why = NATIVE_IGNORED.get(name) if bare == name else SAMPLING_IGNORED.get(bare)
    return why or "unknown to this server"


def parse_generate(body: Any, vocab_size: int, eos_id: int, encode: Callable[[str], list[int]]) -> NativeRequest:
    """A checked /generate body, or ParamError naming the first bad field."""
    if not isinstance(body, dict):
        raise ParamError("the request body must be a JSON object", "body", "invalid_json")
    ignored = check_fields(body, NATIVE_FIELDS, NATIVE_REFUSED)
    input_ids = prompt_of(body, vocab_size, encode)
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise ParamError(
            "'rid' must be a non-empty string (a list is a batch, not supported here)", "rid", "invalid_type"
        )
    stream = boolean(body, "stream", False)
    raw = body.get("sampling_params")
    if not isinstance(raw, dict | None):
        raise ParamError(
            "'sampling_params' must be an object (a list is a batch, not supported here)",
            "sampling_params",
            "invalid_type",
        )
    try:
        params = parse_sampling(raw or {}, vocab_size, eos_id, encode)
    except ParamError as err:  # NOTE: the sampling checks name the bare key ('top_k' ...); the reply its path
        message = str(err).removeprefix("'")
        raise ParamError(f"'sampling_params.{message}", f"sampling_params.{err.param}", err.code) from None
    return NativeRequest(
        input_ids, params.max_tokens, stream, rid, replace(params, ignored=(*ignored, *params.ignored))
    )


def parse_sampling(
    raw: dict[str, Any], vocab_size: int, eos_id: int, encode: Callable[[str], list[int]]
) -> RequestParams:
    """SGLang's sampling_params as the OpenAI routes' RequestParams (n 1, no logprobs), range-checked
    as SGLang's verify() does; ParamError naming the bare key, its message starting with it quoted."""
    unknown = [name for name in raw if name not in SAMPLING_FIELDS + tuple(SAMPLING_IGNORED) + tuple(SAMPLING_REFUSED)]
    if unknown:
        raise ParamError(f"'{unknown[0]}' is not a sampling parameter SGLang knows", unknown[0], "unknown_parameter")
    ignored = check_fields(raw, SAMPLING_FIELDS, SAMPLING_REFUSED)
    max_new_tokens = max_new_tokens_of(raw)
    stop = stop_strings(raw.get("stop"))
    return RequestParams(
        n=1,
        max_tokens=max_new_tokens,
        max_key="sampling_params.max_new_tokens",
        truncate_prompt_tokens=None,
        echo=False,
        num_logprobs=None,
        stop=stop,
        include_stop_str_in_output=boolean(raw, "no_stop_trim", False),
        sampling=sampling_of(raw, vocab_size, eos_id, tuple(tuple(encode(s)) for s in stop), max_new_tokens),
        ignored=tuple(f"sampling_params.{name}" for name in ignored),
    )


def prompt_of(body: dict[str, Any], vocab_size: int, encode: Callable[[str], list[int]]) -> list[int]:
    """The one prompt: `text` or `input_ids` (exactly one of them; a list of either is a batch: 400)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ParamError("give exactly one of 'text' and 'input_ids'", "text", "missing_required_parameter")
    if text is not None:
        if not isinstance(text, str):
            raise ParamError("'text' must be a string (a list is a batch, not supported here)", "text", "invalid_type")
        if not text:
            raise ParamError("'text' is empty", "text")
        return encode(text)
    if not isinstance(ids, list) or not ids or not all(is_int(i) for i in ids):
        raise ParamError(
            "'input_ids' must be a non-empty list of token ids (a list of lists is a batch, not supported here)",
            "input_ids",
            "invalid_type",
        )
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ParamError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "input_ids")
    return list(ids)


def max_new_tokens_of(raw: dict[str, Any]) -> int | None:
    """SGLang's default 128 when absent; None (null): the rest of the context."""
    if "max_new_tokens" in raw and raw["max_new_tokens"] is None:
        return None
    value: int = integer(raw, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, low=0)
    if value == 0:
        raise ParamError(
            "'max_new_tokens' 0 (a prefill alone) is not supported by this server; ask for 1 or more",
            "max_new_tokens",
            "unsupported_parameter",
        )
    return value


def sampling_of(
    raw: dict[str, Any],
    vocab_size: int,
    eos_id: int,
    stop_sequences: tuple[tuple[int, ...], ...],
    max_new_tokens: int | None,
) -> SamplingParams:
    """kvscope's SamplingParams for SGLang's sampling_params, range-checked as SGLang's verify() does."""
    temperature = number(raw, "temperature", 1.0, low=0.0)
    top_p = number(raw, "top_p", 1.0, low=0.0, high=1.0)
    if top_p <= 0:
        raise ParamError(f"'top_p' must be in (0, 1], got {top_p:g}", "top_p")
    top_k: int = integer(raw, "top_k", -1, low=-1)
    if top_k == 0:
        raise ParamError("'top_k' must be -1 (every token) or at least 1", "top_k")
    min_new_tokens: int = integer(raw, "min_new_tokens", 0, low=0)
    if max_new_tokens is not None and min_new_tokens > max_new_tokens:
        raise ParamError(
            f"'min_new_tokens' ({min_new_tokens}) must be <= max_new_tokens ({max_new_tokens})",
            "min_new_tokens",
        )
    return SamplingParams(
        temperature=0.0 if temperature < SGLANG_GREEDY_EPS else temperature,
        top_p=top_p,
        top_k=-1 if top_k >= vocab_size else top_k,
        min_p=number(raw, "min_p", 0.0, low=0.0, high=1.0),
        presence_penalty=number(raw, "presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=number(raw, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        seed=integer(raw, "sampling_seed", None, low=INT64_MIN, high=INT64_MAX),
        logit_bias=logit_bias_of(raw.get("logit_bias"), vocab_size),
        min_tokens=min_new_tokens,
        eos_id=eos_id,
        ignore_eos=boolean(raw, "ignore_eos", False),
        stop_token_ids=token_ids(raw.get("stop_token_ids"), vocab_size),
        stop_sequences=stop_sequences,
    )


def logit_bias_of(value: Any, vocab_size: int) -> dict[int, float]:
    """{token id: bias} as SGLang adds it (not clamped)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ParamError("'logit_bias' must be an object", "logit_bias", "invalid_type")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token_id = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else None
        if token_id is None or not 0 <= token_id < vocab_size:
            raise ParamError(
                f"'logit_bias' key {key!r} is not a token id in [0, {vocab_size})",
                "logit_bias",
            )
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or bias != bias or abs(bias) == float("inf"):
            raise ParamError(
                f"'logit_bias' value for {key!r} must be a finite number",
                "logit_bias",
                "invalid_type",
            )
        out[token_id] = float(bias)
    return out


def finish_reason_json(
    finish_reason: str | None, stop_reason: str | int | None, max_new_tokens: int, eos_id: int, error: str | None
) -> dict[str, Any] | None:
    """SGLang's finish_reason object (None while the request runs)."""
    if finish_reason is None:
        return None
    if finish_reason == "length":
        return {"type": "length", "length": max_new_tokens}
    if finish_reason == "stop":
        return {"type": "stop", "matched": eos_id if stop_reason is None else stop_reason}
    return {"type": "abort", "message": error or "aborted", "status_code": None, "err_type": None}


def meta_info(
    rid: str,
    finish: dict[str, Any] | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    e2e_latency_s: float | None,
) -> dict[str, Any]:
    """SGLang's meta_info; e2e_latency once the request finished."""
    out: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "weight_version": "default",
        "reasoning_tokens": 0,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
    }
    if e2e_latency_s is not None:
        out["e2e_latency"] = e2e_latency_s
    return out
