"""The front and the scheduler exchange msgspec structs: each decodes to what was sent, and a
message meant for the other side (or garbage) is refused, not mistaken for another kind."""

from __future__ import annotations

import msgspec
import pytest

from kvscope.engine.sampling_params import SamplingParams
from kvscope.server.protocol import (
    AbortReq,
    GenerateReq,
    Logprob,
    PoolStats,
    ShutdownReq,
    StatsOut,
    TokenOut,
    decode_to_front,
    decode_to_scheduler,
    encode,
)

SAMPLED = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    seed=-(2**63),
    logit_bias={7: -100.0},
    min_tokens=2,
    eos_id=2,
    stop_token_ids=(9,),
    stop_sequences=((10, 11),),
    num_logprobs=3,
)


@pytest.mark.parametrize(
    "msg",
    [
        GenerateReq("r1", [1, 2, 3], 8, "acme/alice", 1.5),
        AbortReq("r1"),
        GenerateReq("r2", [4], 2, None, 0.0, SAMPLED, 1),
        ShutdownReq(abort_in_flight=True),
    ],
)
def test_messages_to_the_scheduler_round_trip(msg: object) -> None:
    assert decode_to_scheduler(encode(msg)) == msg  # type: ignore[arg-type]


def test_messages_to_the_front_round_trip() -> None:
    stats = StatsOut(3, {"full": PoolStats(64, 10, 54, 8, 2)}, 1, 0, 30, 12, 5, 0, 0, 1, 0)
    logprobs = [Logprob(5, -0.5, [5, 6], [-0.5, -1.5]), Logprob(6, -1.5, [5, 6], [-0.5, -1.5])]
    stopped = TokenOut(
        "r2",
        [5, 6],
        True,
        "stop",
        3,
        0,
        2,
        stop_sequence=0,
        logprobs=logprobs,
        prompt_logprobs=[None, Logprob(4, -2.0, [], [])],
    )
    for msg in (TokenOut("r1", [5, 6], True, "length", 3, 1, 2, None, 0.01), stats, stopped):
        assert decode_to_front(encode(msg)) == msg


def test_a_message_for_the_other_side_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_to_scheduler(encode(TokenOut("r1", [1])))
    with pytest.raises(msgspec.ValidationError):
        decode_to_front(encode(AbortReq("r1")))
    with pytest.raises(msgspec.DecodeError):
        decode_to_front(b"\xc1garbage")
