"""How one request picks its tokens and when it stops (no torch: the HTTP front builds these).

NOTE: the order a logits row goes through (kvscope/engine/sampling.py), as vLLM's sampler:
    raw logits                  -> the logprobs a request asked for (vLLM's "raw_logprobs")
    + logit_bias                   per token id
    penalties                   repetition (prompt + output), frequency and presence (output)
    min_tokens mask             EOS (unless ignore_eos) and stop_token_ids at -inf until
                                min_tokens outputs exist
    greedy (temperature < 1e-5) argmax, the first on a tie
    else / temperature, top_k, top_p, min_p, then one draw from the request's own generator
                                (seeded from `seed`: the same seed, prompt and params give the
                                same tokens, whatever else runs in the batch)
NOTE: when a request ends (Req.finish_check, after each appended token), vLLM's order:
    output_len >= max_new_tokens          "length"
    output_len < min_tokens               go on
    last token == eos_id (no ignore_eos)  "stop", stop_token None
    last token in stop_token_ids          "stop", stop_token = it
    outputs end with a stop sequence      "stop", stop_sequence = its index (also past the
                                          length check: a stop string wins, as in vLLM)
"""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    eos_id: int | None = None  # None: the request never stops on EOS
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token id runs (a stop string's bytes)
    num_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the top k

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < -1 or not 0 <= self.min_p <= 1:
            raise ValueError(
                f"sampling parameters out of range: temperature {self.temperature}, top_p "
                f"{self.top_p}, top_k {self.top_k}, min_p {self.min_p}"
            )
        if self.repetition_penalty <= 0 or self.min_tokens < 0 or (self.num_logprobs or 0) < 0:
            raise ValueError(
                f"sampling parameters out of range: repetition_penalty {self.repetition_penalty}, "
                f"min_tokens {self.min_tokens}, num_logprobs {self.num_logprobs}"
            )
        if any(not seq for seq in self.stop_sequences):
            raise ValueError("a stop sequence is empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the raw logits before the choice."""
        return (
            bool(self.logit_bias)
            or self.min_tokens > 0
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def plain_greedy(self) -> bool:
        """argmax of the raw logits, no logprobs: the batch's one-call fast path."""
        return self.greedy and not self.shapes_logits and self.num_logprobs is None

    def min_tokens_mask(self) -> tuple[int, ...]:
        """The ids kept off until min_tokens outputs exist."""
        eos = () if self.ignore_eos or self.eos_id is None else (self.eos_id,)
        return (*eos, *self.stop_token_ids)


GREEDY = SamplingParams()
