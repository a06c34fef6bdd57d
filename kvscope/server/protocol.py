"""The messages between the HTTP front and the scheduler process (msgspec structs over ZMQ).

    front --PUSH--> scheduler   GenerateReq, AbortReq, ShutdownReq, FlushCacheReq
    front <--PUSH-- scheduler   TokenOut (per request, per step it produced tokens), StatsOut,
                                PagesOut (with --dp-size > 1: the step's cache deltas, for the router),
                                FlushCacheOut (the answer to a FlushCacheReq, by its id)

NOTE: the front tokenizes and detokenizes; the scheduler sees token ids only. A request's
principal is resolved by the front (API key and `user`) and travels as `principal`
("tenant/user", or the plain `user` without keys); the scheduler gives it to Req.user, which
reaches match_prefix, node owners, every event and the requests table.
Every message is one ZMQ frame: `encode(msg)`; `decode_to_scheduler` / `decode_to_front`.
"""

from __future__ import annotations

import msgspec

from kvscope.engine.sampling_params import GREEDY, SamplingParams


class RouteInfo(msgspec.Struct, array_like=True):
    """How the front's router chose this replica (kvscope.telemetry.Routing's fields)."""

    dispatch: str
    routed_cached_tokens: int
    elsewhere_cached_tokens: int


class GenerateReq(msgspec.Struct, tag="generate"):
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    principal: str | None = None
    arrival_wall_s: float = 0.0  # the front's time.time() when the HTTP request arrived
    sampling: SamplingParams = GREEDY
    num_prompt_logprobs: int | None = None  # the prompt's logprobs too (completions' echo + logprobs)
    routing: RouteInfo | None = None  # set by a front routing among several replicas


class AbortReq(msgspec.Struct, tag="abort"):
    rid: str


class ShutdownReq(msgspec.Struct, tag="shutdown"):
    """Stop taking requests; finish (abort_in_flight=False) or abort those in flight; close."""

    abort_in_flight: bool = False


class FlushCacheReq(msgspec.Struct, tag="flush"):
    """SGLang's /flush_cache: flush the prefix cache when nothing runs or waits; with timeout_s > 0,
    wait up to that long for that moment (one such wait at a time)."""

    flush_id: str
    timeout_s: float = 0.0


class Logprob(msgspec.Struct, array_like=True):
    """A token's logprob under the raw logits and the top ones, best first."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class TokenOut(msgspec.Struct, tag="tokens"):
    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the prefix the radix cache matched at first admission
    completion_tokens: int = 0
    error: str | None = None  # a request the scheduler refused (finish_reason "error")
    queue_s: float | None = None  # arrival to first admission, set once admitted
    stop_token: int | None = None  # "stop" on a stop_token_ids entry
    stop_sequence: int | None = None  # "stop" on the stop sequence of this index
    logprobs: list[Logprob] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[Logprob | None] | None = None  # once, with the first message, when asked


class PoolStats(msgspec.Struct):
    total: int
    used: int
    available: int
    evictable: int
    protected: int


class StatsOut(msgspec.Struct, tag="stats"):
    """The scheduler's counters, sent at most every stats interval and at each idle point."""

    step: int
    pools: dict[str, PoolStats]  # "full", and "swa" for a hybrid model
    num_running: int
    num_waiting: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    evicted_tokens: int
    num_retractions: int
    leak_checks_passed: int
    leak_checks_failed: int
    host_hit_tokens: int | None = None  # of cached_tokens, loaded back from the host tier; None: no host tier


class PagesOut(msgspec.Struct, tag="pages"):
    """The full pages the replica's prefix cache gained and lost in a step, by KV-event block hash
    (kv_events.py's); the front starts from none."""

    stored: list[int]
    removed: list[int]


class FlushCacheOut(msgspec.Struct, tag="flushed"):
    flush_id: str
    success: bool
    message: str = ""  # why not, when not


ToScheduler = GenerateReq | AbortReq | ShutdownReq | FlushCacheReq
ToFront = TokenOut | StatsOut | PagesOut | FlushCacheOut

_encoder = msgspec.msgpack.Encoder()
_to_scheduler = msgspec.msgpack.Decoder(ToScheduler)
_to_front = msgspec.msgpack.Decoder(ToFront)


def encode(msg: ToScheduler | ToFront) -> bytes:
    return _encoder.encode(msg)


def decode_to_scheduler(frame: bytes) -> ToScheduler:
    return _to_scheduler.decode(frame)


def decode_to_front(frame: bytes) -> ToFront:
    return _to_front.decode(frame)
