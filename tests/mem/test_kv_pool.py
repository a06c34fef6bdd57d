"""KV buffers: shapes, writes at slots, fp8 storage, bytes, SWA routing through the mapping."""

from __future__ import annotations

import pytest
import torch

from kvscope.mem import (
    MHATokenToKVPool,
    PoolMisuseError,
    SWAKVPool,
    SWATokenToKVPoolAllocator,
    resolve_device,
)
from tests.conftest import device_params


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_buffers_have_padding_rows_and_take_writes_at_slots(device: str, dtype: torch.dtype) -> None:
    pool = MHATokenToKVPool(32, 4, dtype, num_kv_heads=2, head_dim=8, num_layers=3, device=device)
    k, v = pool.get_kv_buffer(1)
    assert k.shape == (36, 2, 8) and v.shape == (36, 2, 8) and k.dtype == dtype
    where = torch.tensor([5, 9, 30], device=device)
    new_k = torch.randn(3, 2, 8, device=device)
    pool.set_kv_buffer(1, where, new_k, new_k * 2)
    torch.testing.assert_close(pool.get_key_buffer(1)[where], new_k.to(dtype))
    torch.testing.assert_close(pool.get_value_buffer(1)[where], (new_k * 2).to(dtype))
    assert pool.get_key_buffer(0).abs().sum() == 0, "another layer was written"
    itemsize = torch.empty(0, dtype=dtype).element_size()
    assert pool.bytes_used() == 3 * 2 * 36 * 2 * 8 * itemsize
    assert pool.bytes_per_token == 3 * 2 * 2 * 8 * itemsize


def test_fp8_is_stored_as_uint8_and_read_back_as_fp8() -> None:
    pool = MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 1, 4, 1)
    assert pool.k_buffer[0].dtype == torch.uint8
    value = torch.tensor([[[0.5, 1.0, -2.0, 0.25]]])
    pool.set_kv_buffer(0, torch.tensor([3]), value, value)
    assert pool.get_key_buffer(0).dtype == torch.float8_e4m3fn
    assert pool.get_key_buffer(0)[3].float().tolist() == value[0].tolist()
    assert pool.bytes_used() == 2 * 9 * 4


def test_unknown_layer_is_a_clear_error() -> None:
    pool = MHATokenToKVPool(8, 1, torch.float32, 1, 4, 2)
    with pytest.raises(PoolMisuseError, match=r"layer 2 outside \[0, 2\)"):
        pool.get_kv_buffer(2)


@pytest.mark.parametrize("device", device_params())
def test_swa_layers_write_through_the_mapping(device: str) -> None:
    alloc = SWATokenToKVPoolAllocator(16, 8, 1, device)
    alloc.alloc(3)  # shift the pairing so full and SWA slots differ after frees
    first = alloc.alloc(2)
    assert first is not None
    alloc.free(first)
    full_slots = alloc.alloc(4)
    assert full_slots is not None
    full = MHATokenToKVPool(16, 1, torch.float32, 1, 2, 2, device, name="full")
    swa = MHATokenToKVPool(8, 1, torch.float32, 1, 2, 1, device, name="swa")
    kv = SWAKVPool(full, swa, swa_layer_ids=[1], full_to_swa_index_mapping=alloc.full_to_swa_index_mapping)
    assert kv.layers_mapping == {0: (0, False), 2: (1, False), 1: (0, True)}
    values = torch.arange(8, dtype=torch.float32, device=device).reshape(4, 1, 2)
    kv.set_kv_buffer(1, full_slots, values, values)
    swa_slots = alloc.translate_loc(full_slots)
    assert swa_slots.tolist() != full_slots.tolist()
    torch.testing.assert_close(kv.get_kv_buffer(1)[0][swa_slots], values)
    kv.set_kv_buffer(2, full_slots, values, values)
    torch.testing.assert_close(kv.get_kv_buffer(2)[0][full_slots], values)
    assert kv.bytes_used() == full.bytes_used() + swa.bytes_used()


def test_resolve_device_defaults_and_errors() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_req_to_token_pool_takes_a_device_and_a_dtype() -> None:
    from kvscope.mem import ReqToTokenPool

    pool = ReqToTokenPool(4, 16, "cpu", dtype=torch.int64)
    assert pool.req_to_token.dtype == torch.int64 and pool.req_to_token.shape == (5, 16)
    pool.write(2, 3, torch.tensor([7, 8]))
    assert pool.read(2, 3, 5).tolist() == [7, 8]
    with pytest.raises(ValueError, match="int32 or int64"):
        ReqToTokenPool(4, 16, "cpu", dtype=torch.float32)
