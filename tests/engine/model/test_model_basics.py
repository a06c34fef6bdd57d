"""Window semantics, seeded weights, batch validation, pool checks, greedy sampling."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.model import (
    ForwardBatch,
    ModelConfig,
    TinyTransformer,
    model_config,
    sample_greedy,
    window_mask,
)
from kvscope.mem import MHATokenToKVPool, ReqToTokenPool, SWAKVPool, SWATokenToKVPoolAllocator
from tests.conftest import device_params


def test_window_mask_sees_the_query_and_the_window_minus_one_tokens_before() -> None:
    positions = torch.arange(6)
    mask = window_mask(positions[:, None], positions[None, :], 3)
    for q in range(6):
        assert [k for k in range(6) if mask[q, k]] == [k for k in range(q - 2, q + 1) if k >= 0]
    causal = window_mask(positions[:, None], positions[None, :], None)
    assert torch.equal(causal, torch.ones(6, 6, dtype=torch.bool).tril())


def test_window_changes_dense_logits_only_beyond_the_window() -> None:
    """Same seed, same weights: the hybrid model equals the full one while the sequence
    fits in the window, and differs once the window starts to cut."""
    window = 8
    full = TinyTransformer(ModelConfig(seed=4))
    hybrid = TinyTransformer(ModelConfig(seed=4, sliding_window=window, swa_layer_ids=(0, 2)))
    tokens = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(0))
    full_logits, hybrid_logits = full.dense_forward(tokens), hybrid.dense_forward(tokens)
    torch.testing.assert_close(hybrid_logits[:window], full_logits[:window], atol=1e-6, rtol=0)
    assert (hybrid_logits[window:] - full_logits[window:]).abs().amax(-1).min() > 1e-3


def test_same_seed_gives_identical_weights_and_another_seed_does_not() -> None:
    cfg = model_config("tiny-swa")
    state_a, state_b = TinyTransformer(cfg).state_dict(), TinyTransformer(cfg).state_dict()
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    other = TinyTransformer(model_config("tiny-swa,seed=1")).state_dict()
    assert not any(torch.equal(state_a[k], other[k]) for k in state_a if state_a[k].numel() > 64)


def test_construction_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    TinyTransformer(model_config("tiny"))
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.cuda
def test_weights_and_logits_are_the_same_on_cuda() -> None:
    cfg = model_config("tiny-swa")
    cpu, cuda = TinyTransformer(cfg, "cpu"), TinyTransformer(cfg, "cuda")
    cuda_state = cuda.state_dict()
    assert all(torch.equal(v, cuda_state[k].cpu()) for k, v in cpu.state_dict().items())
    tokens = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(cuda.dense_forward(tokens).cpu(), cpu.dense_forward(tokens), atol=1e-4, rtol=1e-4)


def test_weights_have_the_configured_dtype_and_logits_are_float32() -> None:
    model = TinyTransformer(model_config("tiny,dtype=bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    logits = model.dense_forward(torch.tensor([1, 2, 3]))
    assert logits.dtype == torch.float32 and logits.shape == (3, 512)
    assert 0.3 < logits.std() < 3, "init scale should keep logits well-conditioned"


def test_forward_batch_build_computes_positions_and_validates() -> None:
    batch = ForwardBatch.build("extend", [5, 6, 7, 8, 9], [2, 1], [3, 0], torch.arange(10, 15), [2, 3])
    assert batch.positions.tolist() == [3, 4, 0, 1, 2]
    assert (batch.num_requests, batch.num_tokens, batch.seq_lens) == (2, 5, [5, 3])
    decode = ForwardBatch.build("decode", [1, 2], [1, 2], [7, 9], torch.tensor([3, 4]))
    assert decode.positions.tolist() == [7, 9] and decode.extend_lens == [1, 1]
    with pytest.raises(ValueError, match="decode extends every request by one token"):
        ForwardBatch.build("decode", [1, 2, 3], [1, 2], [7, 9], torch.tensor([3, 4, 5]), [1, 2])
    with pytest.raises(ValueError, match=r"sum\(extend_lens\) = 3 new tokens"):
        ForwardBatch.build("extend", [1, 2], [1], [0], torch.tensor([3, 4]), [3])
    with pytest.raises(ValueError, match="extend_lens must be >= 1"):
        ForwardBatch.build("extend", [1], [1, 2], [0, 0], torch.tensor([3]), [1, 0])


@pytest.mark.parametrize("device", device_params())
def test_a_pool_of_the_wrong_shape_is_refused(device: str) -> None:
    model = TinyTransformer(model_config("tiny-swa"), device)
    rows = ReqToTokenPool(1, 8, device)
    batch = ForwardBatch.build("extend", [1], [1], [0], torch.tensor([1], device=device), [1])
    three_layers = MHATokenToKVPool(16, 1, torch.float32, 2, 16, 3, device)
    with pytest.raises(ValueError, match="KV pool has 3 layers, the model 4"):
        model(batch, rows, three_layers)
    allocator = SWATokenToKVPoolAllocator(16, 16, 1, device)
    wrong_heads = MHATokenToKVPool(16, 1, torch.float32, 1, 16, 2, device, name="swa")
    full = MHATokenToKVPool(16, 1, torch.float32, 2, 16, 2, device)
    with pytest.raises(ValueError, match=r"\[swa\] KV pool \(kv_heads, head_dim, v_head_dim\) = \(1, 16, 16\)"):
        model(batch, rows, SWAKVPool(full, wrong_heads, [1, 3], allocator.full_to_swa_index_mapping))
    right_heads = MHATokenToKVPool(16, 1, torch.float32, 2, 16, 2, device, name="swa")
    with pytest.raises(ValueError, match=r"SWA layers \(0, 1\), the model \(1, 3\)"):
        model(batch, rows, SWAKVPool(full, right_heads, [0, 1], allocator.full_to_swa_index_mapping))


def test_sample_greedy_takes_the_highest_logit() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])
    assert sample_greedy(logits).tolist() == [1, 0]
