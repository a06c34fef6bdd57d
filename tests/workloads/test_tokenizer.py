"""The byte-level tokenizer: specials first, then UTF-8 bytes; decode inverts encode."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvscope.workloads import ByteTokenizer

TOKENIZER = ByteTokenizer()


def test_ascii_maps_each_byte_past_the_specials() -> None:
    ids = TOKENIZER.encode("Hi!")
    assert ids.dtype == np.int32
    assert ids.tolist() == [ord("H") + 3, ord("i") + 3, ord("!") + 3]
    assert TOKENIZER.decode(ids) == "Hi!"


def test_vocabulary_is_the_specials_plus_256_bytes() -> None:
    assert TOKENIZER.num_special == 3 and TOKENIZER.vocab_size == 259
    assert (TOKENIZER.pad_id, TOKENIZER.bos_id, TOKENIZER.eos_id) == (0, 1, 2)
    assert TOKENIZER.encode("\x00\xff").tolist() == [3, 0xC3 + 3, 0xBF + 3]


def test_non_ascii_text_round_trips() -> None:
    text = "naïve 世界 🙂"
    ids = TOKENIZER.encode(text)
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert TOKENIZER.decode(ids) == text


@given(st.text(max_size=200))
def test_any_text_round_trips(text: str) -> None:
    ids = TOKENIZER.encode(text)
    assert ids.size == 0 or (ids.min() >= TOKENIZER.num_special and ids.max() < TOKENIZER.vocab_size)
    assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.decode(ids.tolist()) == text


@given(st.text(max_size=50), st.lists(st.tuples(st.integers(0, 50), st.sampled_from([0, 1, 2])), max_size=10))
def test_decode_skips_specials_wherever_they_are(text: str, inserts: list[tuple[int, int]]) -> None:
    ids = TOKENIZER.encode(text).tolist()
    for position, special in inserts:
        ids.insert(min(position, len(ids)), special)
    assert TOKENIZER.decode(ids) == text


def test_invalid_bytes_and_ids_past_the_vocabulary_become_replacement_characters() -> None:
    a, b = ord("a") + 3, ord("b") + 3
    assert TOKENIZER.decode([a, 0xE4 + 3, b]) == "a\ufffdb"  # a truncated 3-byte sequence
    assert TOKENIZER.decode([a, 300, b, -1]) == "a\ufffdb\ufffd"
    assert TOKENIZER.decode([]) == ""
