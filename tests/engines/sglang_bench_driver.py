"""SGLang 0.5.23's own `python -m sglang.bench_serving`, run in the SGLang venv with the import-only
stand-ins for its GPU-only imports (tests/engines/sglang_standins) but the real aiohttp, which its
client sends the requests with. Arguments: bench_serving's own; or `--make-tokenizer DIR`, which
saves a byte-level Hugging Face tokenizer (256 ids, no merges) in DIR for its --tokenizer, so
nothing is downloaded."""

from __future__ import annotations

import runpy
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.engines.sglang_standins import install


def make_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make-tokenizer"]:
        make_tokenizer(sys.argv[2])
        sys.exit(0)
    install(real=("aiohttp",))
    warnings.simplefilter("ignore", FutureWarning)  # NOTE: 0.5.23 calls the module path deprecated
    sys.argv = ["sglang.bench_serving", *sys.argv[1:]]
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
