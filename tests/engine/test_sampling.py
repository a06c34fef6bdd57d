"""The engine's sampling (kvscope/engine/sampling_params.py's NOTE): a seeded request draws the same
tokens alone, in a crowded batch and prefilled in chunks; the stop rules end requests in vLLM's
order; the plain greedy path is the model's argmax."""

from __future__ import annotations

import numpy as np
import torch

from kvscope.engine.config import EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import MODEL_PRESETS
from kvscope.engine.request import Req
from kvscope.engine.sampling_params import SamplingParams

RNG = np.random.default_rng(3)
PROMPT = RNG.integers(3, 259, 40).astype(np.int32)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, num_logprobs=2)


def engine(chunk_tokens: int | None = None) -> Engine:
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=4096, max_running_requests=8, max_context_len=256),
        scheduler=SchedulerConfig(chunked_prefill_size=chunk_tokens),
        device="cpu",
        strict=True,
    )
    return Engine(config, MODEL_PRESETS["tiny"])


def run(eng: Engine, *reqs: Req) -> None:
    eng.run(list(reqs))
    eng.check_integrity()


def test_a_seeded_request_draws_the_same_tokens_alone_crowded_and_chunked() -> None:
    alone = Req("a", PROMPT, 24, sampling=SEEDED)
    run(engine(), alone)
    crowd = [
        Req(f"o{i}", RNG.integers(3, 259, 30).astype(np.int32), 20, sampling=SamplingParams(temperature=0.8, seed=i))
        for i in range(4)
    ]
    crowded = Req("a", PROMPT, 24, sampling=SEEDED)
    run(engine(chunk_tokens=16), *crowd[:2], crowded, *crowd[2:])  # NOTE: its prompt is prefilled in 3 chunks
    assert crowded.output_ids == alone.output_ids
    assert len(crowded.output_logprobs) == 24
    other_seed = Req("b", PROMPT, 24, sampling=SamplingParams(temperature=1.0, seed=1235))
    run(engine(), other_seed)
    assert other_seed.output_ids != alone.output_ids


def test_greedy_is_the_dense_models_argmax_and_logprobs_are_the_raw_ones() -> None:
    eng = engine()
    req = Req("g", PROMPT, 6, sampling=SamplingParams(num_logprobs=3))
    run(eng, req)
    sequence = torch.as_tensor(np.concatenate((PROMPT, req.output_ids[:-1])), dtype=torch.int64)
    logits = eng.model.dense_forward(sequence)[len(PROMPT) - 1 :]
    assert req.output_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1)
    for position, (token, lp) in enumerate(zip(req.output_ids, req.output_logprobs, strict=True)):
        assert lp.top_ids[0] == token and len(lp.top_ids) == 3
        assert abs(lp.logprob - float(expected[position, token])) < 1e-4


def test_stop_rules_in_vllms_order() -> None:
    eng = engine()
    x = 3 + ord("x")
    always_x = {x: 100.0}
    stop_seq = Req(
        "s", PROMPT, 10, sampling=SamplingParams(logit_bias=always_x, stop_sequences=((x, x),), min_tokens=3)
    )
    stop_id = Req("t", PROMPT, 10, sampling=SamplingParams(logit_bias=always_x, stop_token_ids=(x,)))
    eos = Req("e", PROMPT, 10, sampling=SamplingParams(logit_bias=always_x, eos_id=x))
    ignored = Req("i", PROMPT, 10, sampling=SamplingParams(logit_bias=always_x, eos_id=x, ignore_eos=True))
    masked = Req("m", PROMPT, 10, sampling=SamplingParams(logit_bias={x: 100.0, 2: 99.0}, eos_id=x, min_tokens=2))
    last = Req("l", PROMPT, 1, sampling=SamplingParams(logit_bias=always_x, eos_id=x))
    run(eng, stop_seq, stop_id, eos, ignored, masked, last)
    assert (len(stop_seq.output_ids), stop_seq.finish_reason, stop_seq.stop_sequence) == (3, "stop", 0)
    assert (len(stop_id.output_ids), stop_id.finish_reason, stop_id.stop_token) == (1, "stop", x)
    assert (len(eos.output_ids), eos.finish_reason, eos.stop_token) == (1, "stop", None)
    assert (len(ignored.output_ids), ignored.finish_reason) == (10, "length")
    assert masked.output_ids == [2, 2, x] and masked.finish_reason == "stop"  # EOS kept off for two tokens
    assert last.finish_reason == "length"  # the length cap is checked first, as in vLLM
