"""Deterministic JSONL traces for the radix-cache benchmark (bench_radix.py).

    .venv/bin/python benchmarks/gen_traces.py [--out-dir benchmarks/traces] [--seed 0]

One request per line: {"id": str, "user": str, "prompt": [token ids], "output": [token ids]},
token ids in [0, 32000). The same seed gives byte-identical files.

NOTE: the two traces
    shared_prefix.jsonl  64 system prompts of 1,024 tokens; 4,000 requests, each a random
                         system prompt + 256 tokens of its own; 128 output tokens.
    multi_turn.jsonl     1,000 conversations x 8 turns; a turn's prompt is the previous
                         turn's prompt + its output + 200 new tokens; 200 output tokens.
                         At most 64 conversations are open at once: each line is the next
                         turn of a conversation picked at random among the open ones, and a
                         new conversation opens when one finishes.
The first token of every request's own suffix (shared_prefix) and of every conversation
(multi_turn) is distinct, drawn without replacement, so no two of them share even one
token by chance past the intended prefix.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

VOCAB_SIZE = 32_000

NUM_SYSTEM_PROMPTS = 64
SYSTEM_PROMPT_LEN = 1_024
NUM_SHARED_PREFIX_REQUESTS = 4_000
UNIQUE_SUFFIX_LEN = 256
SHARED_PREFIX_OUTPUT_LEN = 128
NUM_SHARED_PREFIX_USERS = 256

NUM_CONVERSATIONS = 1_000
NUM_TURNS = 8
TURN_NEW_LEN = 200
TURN_OUTPUT_LEN = 200
MAX_OPEN_CONVERSATIONS = 64
NUM_MULTI_TURN_USERS = 256

DEFAULT_OUT_DIR = Path(__file__).with_name("traces")


def ids_text(ids: np.ndarray) -> str:
    """Token ids as the inside of a JSON list ("1,2,3")."""
    return ",".join(map(str, ids.tolist()))


def line(rid: str, user: str, prompt_text: str, output_text: str) -> str:
    return f'{{"id":"{rid}","user":"{user}","prompt":[{prompt_text}],"output":[{output_text}]}}\n'


def distinct_tokens(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    return rng.choice(VOCAB_SIZE, size=num_tokens, replace=False)


def shared_prefix_lines(rng: np.random.Generator) -> Iterator[str]:
    system_prompts = rng.integers(0, VOCAB_SIZE, (NUM_SYSTEM_PROMPTS, SYSTEM_PROMPT_LEN))
    system_texts = [ids_text(p) for p in system_prompts]
    picks = rng.integers(0, NUM_SYSTEM_PROMPTS, NUM_SHARED_PREFIX_REQUESTS)
    users = rng.integers(0, NUM_SHARED_PREFIX_USERS, NUM_SHARED_PREFIX_REQUESTS)
    suffixes = rng.integers(0, VOCAB_SIZE, (NUM_SHARED_PREFIX_REQUESTS, UNIQUE_SUFFIX_LEN))
    suffixes[:, 0] = distinct_tokens(rng, NUM_SHARED_PREFIX_REQUESTS)
    outputs = rng.integers(0, VOCAB_SIZE, (NUM_SHARED_PREFIX_REQUESTS, SHARED_PREFIX_OUTPUT_LEN))
    for i in range(NUM_SHARED_PREFIX_REQUESTS):
        prompt_text = f"{system_texts[picks[i]]},{ids_text(suffixes[i])}"
        yield line(f"sp{i:05d}", f"user{users[i]:03d}", prompt_text, ids_text(outputs[i]))


def multi_turn_lines(rng: np.random.Generator) -> Iterator[str]:
    """Turns of up to MAX_OPEN_CONVERSATIONS open conversations, interleaved at random."""
    first_tokens = distinct_tokens(rng, NUM_CONVERSATIONS)
    users = rng.integers(0, NUM_MULTI_TURN_USERS, NUM_CONVERSATIONS)
    # NOTE: open conversation c -> [turn index, text of its context so far (prompt + output)]
    open_convs: dict[int, list] = {}
    next_conv = 0
    while open_convs or next_conv < NUM_CONVERSATIONS:
        while len(open_convs) < MAX_OPEN_CONVERSATIONS and next_conv < NUM_CONVERSATIONS:
            open_convs[next_conv] = [0, ""]
            next_conv += 1
        conv = list(open_convs)[rng.integers(0, len(open_convs))]
        turn, context_text = open_convs[conv]
        new_ids = rng.integers(0, VOCAB_SIZE, TURN_NEW_LEN)
        if turn == 0:
            new_ids[0] = first_tokens[conv]
        output_text = ids_text(rng.integers(0, VOCAB_SIZE, TURN_OUTPUT_LEN))
        prompt_text = f"{context_text},{ids_text(new_ids)}" if context_text else ids_text(new_ids)
        yield line(f"mt{conv:04d}-t{turn}", f"user{users[conv]:03d}", prompt_text, output_text)
        if turn + 1 == NUM_TURNS:
            del open_convs[conv]
        else:
            open_convs[conv] = [turn + 1, f"{prompt_text},{output_text}"]


def write_trace(path: Path, lines: Iterator[str]) -> int:
    num_lines = 0
    with path.open("w") as f:
        for text in lines:
            f.write(text)
            num_lines += 1
    return num_lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, make_lines, offset in (
        ("shared_prefix", shared_prefix_lines, 0),
        ("multi_turn", multi_turn_lines, 1),
    ):
        start = time.perf_counter()
        path = args.out_dir / f"{name}.jsonl"
        rng = np.random.default_rng([args.seed, offset])
        num_lines = write_trace(path, make_lines(rng))
        size_mb = path.stat().st_size / 1e6
        print(f"{path}: {num_lines} requests, {size_mb:.1f} MB, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
