"""The memory system is right when the model cannot tell it is there: logits through the
pools (chunked prefill, batched decode, window freeing, pages of 1 and 4, shared prefixes)
equal those of a dense forward without any pool."""

from __future__ import annotations

import random

import pytest
import torch

from kvscope.engine.model import ForwardBatch, TinyTransformer, model_config, sample_greedy
from kvscope.mem import MHATokenToKVPool, ReqToTokenPool, make_token_allocator
from tests.conftest import device_params
from tests.engine.model.harness import PoolHarness, Seq

ATOL = RTOL = 1e-5  # float32
PRESETS = ["tiny", "tiny-swa"]
_MODELS: dict[tuple[str, str], TinyTransformer] = {}


def get_model(name: str, device: str) -> TinyTransformer:
    """One model per (config, device) for the whole module: construction is the slow part."""
    if (name, device) not in _MODELS:
        _MODELS[name, device] = TinyTransformer(model_config(name), device)
    return _MODELS[name, device]


def random_tokens(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def assert_matches_dense(model: TinyTransformer, seq: Seq, logits: torch.Tensor, first_pos: int) -> None:
    """`logits` are those of positions [first_pos, first_pos + len(logits)) of `seq`."""
    dense = model.dense_forward(torch.tensor(seq.token_ids[: first_pos + len(logits)]))
    assert not logits.isnan().any(), "a forward read a poisoned (freed or never written) slot"
    torch.testing.assert_close(logits, dense[first_pos:], atol=ATOL, rtol=RTOL)


def run_chunked_prefill(harness: PoolHarness, seqs: list[Seq], rng: random.Random, max_chunk_len: int) -> None:
    """Every unfinished request gets a random chunk per step, all in one extend batch."""
    prompt_lens = [len(s.token_ids) for s in seqs]
    while pending := [s for s, n in zip(seqs, prompt_lens, strict=True) if s.kv_len < n]:
        chunk_lens = [min(rng.randint(1, max_chunk_len), len(s.token_ids) - s.kv_len) for s in pending]
        starts = [s.kv_len for s in pending]
        logits = harness.extend(pending, chunk_lens, all_logits=True)
        for seq, start, part in zip(pending, starts, logits.split(chunk_lens), strict=True):
            assert_matches_dense(harness.model, seq, part, start)


def run_greedy_decode(harness: PoolHarness, seqs: list[Seq], num_steps: int) -> None:
    for _ in range(num_steps):
        last = torch.stack([harness.model.dense_forward(torch.tensor(s.token_ids))[-1] for s in seqs])
        for seq, token in zip(seqs, sample_greedy(last).tolist(), strict=True):
            seq.token_ids.append(token)
        logits = harness.decode(seqs)
        for seq, row in zip(seqs, logits, strict=True):
            assert_matches_dense(harness.model, seq, row[None], seq.kv_len - 1)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_one_shot_prefill_matches_dense_at_every_position(preset: str, page_size: int, device: str) -> None:
    rng = random.Random(1)
    model = get_model(preset, device)
    harness = PoolHarness(model, page_size)
    seqs = [Seq(random_tokens(rng, n, model.config.vocab_size)) for n in (45, 70)]
    logits = harness.extend(seqs, [45, 70], all_logits=True)
    for seq, part in zip(seqs, logits.split([45, 70]), strict=True):
        assert_matches_dense(model, seq, part, 0)
    last_only = harness.extend([Seq(s.token_ids) for s in seqs], [45, 70])
    torch.testing.assert_close(last_only, logits[[44, 114]], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill_then_batched_decode_matches_dense(preset: str, page_size: int, device: str) -> None:
    """Three requests of different lengths; hybrid models free out-of-window SWA slots each step."""
    rng = random.Random(2 + page_size)
    model = get_model(preset, device)
    harness = PoolHarness(model, page_size)
    seqs = [Seq(random_tokens(rng, n, model.config.vocab_size)) for n in (23, 58, 97)]
    run_chunked_prefill(harness, seqs, rng, max_chunk_len=24)
    run_greedy_decode(harness, seqs, num_steps=6)
    if model.config.is_hybrid:
        assert harness.num_swa_slots_freed > 0, "the window never freed anything: the test proves nothing"


@pytest.mark.parametrize(
    "shape",
    ["layers=3,heads=4,kv_heads=4,head_dim=8,window=6,swa_layers=0:1", "layers=2,heads=8,kv_heads=1,hidden=48"],
)
def test_other_shapes_match_dense(shape: str) -> None:
    """Plain multi-head and multi-query attention, two SWA layers in a row, a window of 6."""
    rng = random.Random(7)
    model = TinyTransformer(model_config(shape))
    harness = PoolHarness(model, 4)
    seqs = [Seq(random_tokens(rng, n, model.config.vocab_size)) for n in (19, 33)]
    run_chunked_prefill(harness, seqs, rng, max_chunk_len=9)
    run_greedy_decode(harness, seqs, num_steps=3)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [5, 32])
def test_swa_layers_never_read_a_freed_slot(window: int, page_size: int, device: str) -> None:
    """A small SWA pool: freed SWA slots are poisoned, then reused by later tokens."""
    rng = random.Random(window * page_size)
    model = TinyTransformer(model_config(f"tiny-swa,window={window}"), device)
    swa_size = 160
    harness = PoolHarness(model, page_size, swa_size=swa_size)
    seqs = [Seq(random_tokens(rng, n, model.config.vocab_size)) for n in (40, 75, 110)]
    assert sum(len(s.token_ids) for s in seqs) > swa_size, "SWA slots must be reused for this test to bite"
    run_chunked_prefill(harness, seqs, rng, max_chunk_len=16)
    run_greedy_decode(harness, seqs, num_steps=4)
    assert harness.num_swa_slots_freed > 0


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_requests_sharing_prefix_slots_get_their_own_dense_logits(preset: str, page_size: int, device: str) -> None:
    """Two rows point at the same slots for a shared prefix, as a prefix cache hands them out."""
    rng = random.Random(3)
    model = get_model(preset, device)
    harness = PoolHarness(model, page_size, free_window=False)
    parent = Seq(random_tokens(rng, 44, model.config.vocab_size))
    harness.extend([parent], [40])
    shared_len = 36
    child = harness.fork(
        parent, parent.token_ids[:shared_len] + random_tokens(rng, 30, model.config.vocab_size), shared_len
    )
    logits = harness.extend([parent, child], [4, 30], all_logits=True)
    parent_part, child_part = logits.split([4, 30])
    assert_matches_dense(model, parent, parent_part, 40)
    assert_matches_dense(model, child, child_part, shared_len)
    run_greedy_decode(harness, [parent, child], num_steps=3)


@pytest.mark.parametrize("device", device_params())
def test_hybrid_model_on_a_plain_pool_keeps_its_window_in_the_mask(device: str) -> None:
    """Hybrid memory off: SWA layers live in the full pool, and the logits do not change."""
    rng = random.Random(4)
    model = get_model("tiny-swa", device)
    cfg = model.config
    rows = ReqToTokenPool(2, 128, device)
    allocator = make_token_allocator(256, 1, device)
    kv_pool = MHATokenToKVPool(256, 1, torch.float32, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, device)
    seq = Seq(random_tokens(rng, 80, cfg.vocab_size))
    rows.alloc([seq])
    assert seq.req_pool_idx is not None
    for start, ext in ((0, 50), (50, 30)):
        slots = allocator.alloc(ext)
        assert slots is not None
        rows.write(seq.req_pool_idx, start, slots)
        batch = ForwardBatch.build(
            "extend", seq.token_ids[start : start + ext], [seq.req_pool_idx], [start], slots, [ext]
        )
        assert_matches_dense(model, seq, model(batch, rows, kv_pool, all_logits=True), start)


@pytest.mark.parametrize("preset", PRESETS)
def test_attention_reads_through_req_to_token(preset: str) -> None:
    """Guard against a test that cannot fail: point one in-window position of a row at an
    unwritten (NaN) slot and the logits turn NaN; the poison and the row are both live."""
    rng = random.Random(5)
    model = get_model(preset, "cpu")
    harness = PoolHarness(model, 1)
    seq = Seq(random_tokens(rng, 41, model.config.vocab_size))
    harness.extend([seq], [40])
    assert seq.req_pool_idx is not None
    harness.rows.req_to_token[seq.req_pool_idx, 30] = 0  # the padding slot, never written
    logits = harness.extend([seq], [1])
    assert logits.isnan().all()


def test_low_precision_paths_agree_on_greedy_tokens() -> None:
    """bfloat16 weights and pools: paged and dense logits agree to bf16 precision."""
    rng = random.Random(6)
    model = TinyTransformer(model_config("tiny-swa,dtype=bfloat16"))
    harness = PoolHarness(model, 4)
    seqs = [Seq(random_tokens(rng, n, model.config.vocab_size)) for n in (30, 66)]
    logits = harness.extend(seqs, [30, 66])
    for seq, row in zip(seqs, logits, strict=True):
        dense = model.dense_forward(torch.tensor(seq.token_ids))[-1]
        torch.testing.assert_close(row, dense, atol=0.1, rtol=0.05)
