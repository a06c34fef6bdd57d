"""One choice of a completions or chat reply: its text as tokens arrive, its logprobs, how it ended.

    choice = Choice(0, chat=False, params, prompt_ids)   # prompt_ids: echo / prompt logprobs
    piece = choice.feed(token_out)                       # text released now, logprob entries
    choice.finish_reason, choice.stop_reason

NOTE: text. Output ids become text through one incremental UTF-8 decoder (the byte tokenizer:
id b + 3 is byte b; pad/bos/eos decode to nothing; an id past the bytes is one U+FFFD). With
stop strings, the last (longest stop - 1) ids stay unreleased until more arrive, so a stream
never shows part of a stop string that the request then stops on. On "stop", the ids that
stopped it (the stop string's, or the stop token) are left out of the text unless
include_stop_str_in_output, as vLLM does; usage counts them.
NOTE: logprobs are the raw model's (before temperature, penalties, bias), one entry per
generated token, stop tokens included; a token's text is its character, `bytes:\\xNN` for a
byte that is not ASCII, or `<|pad|>`, `<|bos|>`, `<|eos|>`, `<|id_N|>`.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvscope.server.openai_params import RequestParams
from kvscope.server.protocol import Logprob, TokenOut
from kvscope.workloads.tokenizer import NUM_SPECIAL, ByteTokenizer

SPECIAL_TEXT = ("<|pad|>", "<|bos|>", "<|eos|>")
BYTE_END = NUM_SPECIAL + 256


class Detokenizer:
    """Incremental byte-tokenizer decoding: text is released once its UTF-8 bytes are complete,
    and the whole text equals ByteTokenizer.decode of all the ids."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: list[int], final: bool = False) -> str:
        data = bytes(i - NUM_SPECIAL if i < BYTE_END else 0xFF for i in ids if i >= NUM_SPECIAL)
        return self.decoder.decode(data, final)


def token_text(token_id: int) -> str:
    if token_id < NUM_SPECIAL:
        return SPECIAL_TEXT[token_id]
    if token_id >= BYTE_END:
        return f"<|id_{token_id}|>"
    byte = token_id - NUM_SPECIAL
    return chr(byte) if byte < 0x80 else f"bytes:\\x{byte:02x}"


def token_bytes(token_id: int) -> list[int] | None:
    return [token_id - NUM_SPECIAL] if NUM_SPECIAL <= token_id < BYTE_END else None


class Entry(NamedTuple):
    """One token of the logprobs: its id, logprob (None: the prompt's first), the top ones, its text offset."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None
    text_offset: int


class Piece(NamedTuple):
    text: str
    entries: list[Entry]


@dataclass
class Choice:
    index: int
    chat: bool
    params: RequestParams
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    num_released: int = 0  # ids already turned into text
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_chars: int = 0  # characters of the text so far, echo included (text offsets)

    def __post_init__(self) -> None:
        self.text = Detokenizer()
        self.offsets = Detokenizer()
        seqs = self.params.sampling.stop_sequences
        self.holdback = max((len(s) for s in seqs), default=1) - 1

    def echo(self, prompt_logprobs: list[Logprob | None] | None) -> Piece:
        """The prompt, as completions' echo sends it before the output."""
        text = ByteTokenizer().decode(self.prompt_ids)
        lps: list[Logprob | None] = (
            list(prompt_logprobs) if prompt_logprobs is not None else [None] * len(self.prompt_ids)
        )
        return Piece(text, self.entries(self.prompt_ids, lps))

    def feed(self, out: TokenOut) -> Piece:
        self.ids.extend(out.new_token_ids)
        wanted = self.params.num_logprobs is not None and out.logprobs is not None
        entries = self.entries(out.new_token_ids, out.logprobs or []) if wanted else []
        if not out.finished:
            end = max(self.num_released, len(self.ids) - self.holdback)
            return Piece(self.release(end, final=False), entries)
        self.finish_reason = out.finish_reason or "length"
        return Piece(self.release(len(self.ids) - self.num_trimmed(out), final=True), entries)

    def num_trimmed(self, out: TokenOut) -> int:
        """The trailing ids that stopped the request and stay out of the text."""
        if out.finish_reason != "stop":
            return 0
        if out.stop_sequence is not None:
            self.stop_reason = self.params.stop[out.stop_sequence]
            keep = self.params.include_stop_str_in_output
            return 0 if keep else len(self.params.sampling.stop_sequences[out.stop_sequence])
        self.stop_reason = out.stop_token
        return 0 if self.params.include_stop_str_in_output else 1

    def release(self, end: int, final: bool) -> str:
        end = max(end, self.num_released)
        text = self.text.feed(self.ids[self.num_released : end], final)
        self.num_released = end
        return text

    def entries(self, ids: list[int], logprobs: list[Logprob] | list[Logprob | None]) -> list[Entry]:
        out = []
        for token_id, lp in zip(ids, logprobs, strict=True):
            offset = self.num_chars
            self.num_chars += len(self.offsets.feed([token_id]))
            if lp is None:
                out.append(Entry(token_id, None, None, offset))
            else:
                out.append(Entry(token_id, lp.logprob, list(zip(lp.top_ids, lp.top_logprobs, strict=True)), offset))
        return out


def render_logprobs(entries: list[Entry], chat: bool) -> dict[str, Any]:
    """OpenAI's logprobs object: chat's {"content": [...]} or completions' parallel lists."""
    if chat:
        return {"content": [chat_entry(e) for e in entries], "refusal": None}
    return {
        "tokens": [token_text(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [completion_top(e) for e in entries],
        "text_offset": [e.text_offset for e in entries],
    }


def chat_entry(entry: Entry) -> dict[str, Any]:
    top = [{"token": token_text(i), "logprob": lp, "bytes": token_bytes(i)} for i, lp in entry.top or []]
    return {
        "token": token_text(entry.token_id),
        "logprob": entry.logprob,
        "bytes": token_bytes(entry.token_id),
        "top_logprobs": top,
    }


def completion_top(entry: Entry) -> dict[str, float] | None:
    """The top tokens and the chosen one (vLLM adds the chosen token when it is not among them)."""
    if entry.logprob is None:
        return None
    top = {token_text(i): lp for i, lp in entry.top or []}
    top.setdefault(token_text(entry.token_id), entry.logprob)
    return top
