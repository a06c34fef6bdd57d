"""A byte-level tokenizer, so text traces run on the tiny model without a vocabulary file.

NOTE: id map (vocab_size = 256 + NUM_SPECIAL = 259)
    0            pad
    1            bos
    2            eos
    [3, 259)     UTF-8 byte b  ->  id b + NUM_SPECIAL
Workload generators draw ids from [NUM_SPECIAL, vocab_size), so they never emit a special.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvscope.workloads.request import TOKEN_DTYPE

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3
NUM_BYTES = 256
_INVALID_BYTE = 0xFF


class ByteTokenizer:
    """UTF-8 bytes shifted past the special ids. Stateless; one instance serves every caller."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    num_special = NUM_SPECIAL
    vocab_size = NUM_BYTES + NUM_SPECIAL

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as a 1-D int32 array of ids; no bos/eos is added."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE) + NUM_SPECIAL

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text for `ids`: specials are skipped; invalid UTF-8, and ids past the byte range
        (a model with a larger vocabulary), become U+FFFD."""
        flat = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64).reshape(-1)
        flat = flat[(flat < 0) | (flat >= NUM_SPECIAL)]
        # NOTE: 0xFF never occurs in UTF-8, so an out-of-range id decodes to exactly one U+FFFD.
        in_range = flat < self.vocab_size
        byte_values = np.where(in_range & (flat >= 0), flat - NUM_SPECIAL, _INVALID_BYTE)
        return byte_values.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
