"""A completions or chat request as the front runs it: the validated request (GenRequest), one
scheduler request per choice (Child), each choice's progress (Run: what the client was sent, the
usage so far), and OpenAI's usage of a reply."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvscope.engine.sampling_params import SamplingParams
from kvscope.server.choice import Choice, Entry, Piece
from kvscope.server.openai_params import RequestParams
from kvscope.server.protocol import TokenOut


@dataclass
class Outcome:
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class GenRequest:
    """A validated completions or chat request: one or more prompts, `params.n` choices each."""

    chat: bool
    prompts: list[list[int]]
    max_tokens: list[int]  # per prompt
    stream: bool
    include_usage: bool
    principal: str | None
    arrival_wall_s: float
    params: RequestParams
    continuous_usage: bool = False  # every chunk carries its choice's usage so far (vLLM's continuous_usage_stats)

    def children(self, rid: str) -> list[Child]:
        """One scheduler request per choice: choice index = prompt index * n + i. Choice i of a
        seeded request draws from seed + i (vLLM's rule), so n > 1 gives n different samples."""
        n, sampling = self.params.n, self.params.sampling
        echo_logprobs = self.params.num_logprobs if self.params.echo else None
        out = []
        for p, (prompt, max_tokens) in enumerate(zip(self.prompts, self.max_tokens, strict=True)):
            for i in range(n):
                index = p * n + i
                seed = None if sampling.seed is None else sampling.seed + i
                own = sampling if seed == sampling.seed else replace(sampling, seed=seed)
                child_rid = rid if len(self.prompts) * n == 1 else f"{rid}-{index}"
                out.append(Child(child_rid, index, prompt, max_tokens, own, echo_logprobs))
        return out


@dataclass
class Child:
    """One choice's scheduler request."""

    rid: str
    index: int
    input_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    num_prompt_logprobs: int | None


@dataclass
class Run:
    """A choice in progress: what the client has been sent and the usage so far."""

    child: Child
    choice: Choice
    echo: bool
    outcome: Outcome = field(default_factory=Outcome)
    text: str = ""
    entries: list[Entry] = field(default_factory=list)

    def take(self, out: TokenOut) -> Piece:
        """`out`'s text and logprob entries (the prompt first, for echo, with the first message)."""
        absorb(self.outcome, out)
        piece = self.choice.feed(out) if not self.echo else self.with_echo(out)
        self.text += piece.text
        self.entries += piece.entries
        return piece

    def with_echo(self, out: TokenOut) -> Piece:
        """NOTE: with return_token_ids the echoed prompt is left out of the text (its ids are in the
        reply), as vLLM 0.32 does."""
        self.echo = False
        head, tail = self.choice.echo(out.prompt_logprobs), self.choice.feed(out)
        head_text = "" if self.choice.params.return_token_ids else head.text
        return Piece(head_text + tail.text, head.entries + tail.entries)


def usage_so_far(run: Run) -> dict[str, int]:
    """One choice's usage after the tokens streamed so far (vLLM's continuous_usage_stats)."""
    prompt, completion = run.outcome.prompt_tokens or len(run.child.input_ids), len(run.outcome.ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage(runs: list[Run]) -> dict[str, Any]:
    """OpenAI's usage of a whole reply: each prompt counted once (its first choice's), every choice's output."""
    firsts = [run.outcome for run in runs if run.child.index % run.choice.params.n == 0]
    prompt = sum(o.prompt_tokens for o in firsts)
    cached = sum(o.cached_tokens for o in firsts)
    completion = sum(run.outcome.completion_tokens or len(run.outcome.ids) for run in runs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def absorb(outcome: Outcome, out: TokenOut) -> None:
    outcome.ids.extend(out.new_token_ids)
    outcome.prompt_tokens = out.prompt_tokens or outcome.prompt_tokens
    outcome.cached_tokens = out.cached_tokens or outcome.cached_tokens
    outcome.completion_tokens = out.completion_tokens or outcome.completion_tokens
    if out.finished:
        outcome.finish_reason = out.finish_reason or "length"
        outcome.error = out.error
