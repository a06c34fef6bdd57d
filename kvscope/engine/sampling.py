"""Choosing each request's next token from its logits row (the order: sampling_params.py's NOTE).

    tokens = choose_tokens(batch, logits)   # one int per request; logprobs appended to the requests
                                            # that asked for them

A batch whose requests are all plain greedy costs one argmax, as before sampling existed.
"""

from __future__ import annotations

import secrets

import torch

from kvscope.engine.request import Req, TokenLogprob
from kvscope.engine.sampling_params import SamplingParams

SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes [0, 2**64)


def choose_tokens(batch: list[Req], logits: torch.Tensor) -> list[int]:
    """The next token of each request of `batch` (logits [len(batch), vocab]): sampled, or a trace's
    forced one; a request asking for logprobs gets one TokenLogprob appended for it."""
    if all(r.sampling.plain_greedy for r in batch):
        sampled: list[int] = logits.argmax(-1).tolist()  # NOTE: one device sync per step
        return [req.next_token(token) for req, token in zip(batch, sampled, strict=True)]
    rows = logits.float().cpu()
    return [choose_one(req, row) for req, row in zip(batch, rows, strict=True)]


def choose_one(req: Req, raw: torch.Tensor) -> int:
    params = req.sampling
    logits = shaped_logits(req, raw) if params.shapes_logits else raw
    if params.greedy:
        sampled = int(logits.argmax())
    else:
        sampled = draw(logits, params, generator_of(req))
    token = req.next_token(sampled)
    if params.num_logprobs is not None:
        req.output_logprobs.append(token_logprob(raw, token, params.num_logprobs))
    return token


def shaped_logits(req: Req, raw: torch.Tensor) -> torch.Tensor:
    """Bias, penalties and the min_tokens mask applied to a copy of `raw`."""
    params, logits = req.sampling, raw.clone()
    vocab_size = logits.numel()
    for token_id, bias in params.logit_bias.items():
        if token_id < vocab_size:
            logits[token_id] += bias
    if params.repetition_penalty != 1.0:
        seen = torch.as_tensor(req.all_ids(), dtype=torch.int64).unique()
        seen = seen[seen < vocab_size]
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and req.output_ids:
        counts = torch.bincount(torch.as_tensor(req.output_ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if len(req.output_ids) < params.min_tokens:
        masked = [i for i in params.min_tokens_mask() if i < vocab_size]
        logits[masked] = float("-inf")
    return logits


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One draw from softmax(logits / temperature) cut by top_k, top_p and min_p."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    sorted_probs = probs[order]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
    if params.top_p < 1.0:
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # NOTE: the token that crosses top_p stays
        keep &= before < params.top_p
    if params.min_p > 0.0:
        keep &= sorted_probs >= params.min_p * sorted_probs[0]
    keep[0] = True
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    index = int(torch.multinomial(kept, 1, generator=generator))
    return int(order[index])


def generator_of(req: Req) -> torch.Generator:
    """The request's generator: seeded from its seed, or from the OS when it has none."""
    if req.generator is None:
        seed = req.sampling.seed
        seed = secrets.randbits(63) if seed is None else seed % SEED_MODULUS
        req.generator = torch.Generator(device="cpu").manual_seed(seed)
    return req.generator


def token_logprob(raw: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    top = torch.topk(logprobs, min(num_top, logprobs.numel())) if num_top else None
    top_ids = top.indices.tolist() if top is not None else []
    top_values = top.values.tolist() if top is not None else []
    return TokenLogprob(float(logprobs[token]), top_ids, top_values)


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], num_top: int) -> list[TokenLogprob | None]:
    """Each prompt token's logprob given the ones before it (logits [len(prompt), vocab] of a dense
    forward); the first token has none."""
    out: list[TokenLogprob | None] = [None]
    rows = logits.float().cpu()
    for position, token in enumerate(prompt_ids[1:]):
        out.append(token_logprob(rows[position], token, num_top))
    return out
