"""Request caching through the two-tier cache (the shared tree/requests.py bookkeeping): a
finished request that recomputes a host-only prefix hands its slots to the tree (the
adopting insert), and one admitted with a load-back (init_load_back, as the PrefillAdder
calls it) finishes with both tiers conserved and its K/V read back intact."""

from __future__ import annotations

import numpy as np
import torch

from kvscope.cache import EvictParams
from kvscope.mem import ReqToTokenPool
from tests.cache.helpers import Req
from tests.cache.hiradix.helpers import Tiers, check_all, make_tiers, read_device, write_encoded

PROMPT = np.arange(50, 70, dtype=np.int32)  # 20 tokens


def admit(t: Tiers, rows: ReqToTokenPool, rid: str, load: bool) -> Req:
    """Match, optionally load back the host hit, lock, and compute the rest of the prompt."""
    req = Req(rid, PROMPT.copy())
    match = t.cache.match_prefix(PROMPT)
    prefix, last = match.device_indices, match.last_node
    if load and match.host_hit_length:
        loaded, last = t.cache.init_load_back(match.last_host_node, match.host_hit_length)
        prefix = torch.cat((prefix, loaded))
    t.cache.inc_lock_ref(last)
    assert rows.alloc([req]) is not None and req.req_pool_idx is not None
    rows.write(req.req_pool_idx, 0, prefix)
    rest = t.allocator.alloc(len(PROMPT) - len(prefix))
    assert rest is not None
    write_encoded(t, PROMPT[len(prefix) :], rest, start=len(prefix))
    rows.write(req.req_pool_idx, len(prefix), rest)
    req.last_node, req.cache_protected_len, req.prefix_indices = last, len(prefix), prefix
    req.kv_committed_len = len(PROMPT)
    return req


def finish(t: Tiers, rows: ReqToTokenPool, req: Req) -> None:
    t.cache.cache_finished_req(req)
    rows.free(req)
    t.cache.writing_check()
    t.cache.loading_check()


def demote_all(t: Tiers) -> None:
    t.cache.writing_check()
    t.cache.evict(EvictParams(t.cache.evictable_size()))


def test_recomputed_request_hands_its_slots_to_the_host_only_node() -> None:
    rows = ReqToTokenPool(4, 64, "cpu", strict=True)
    t = make_tiers("write_through", rows=rows)
    finish(t, rows, admit(t, rows, "a", load=False))
    demote_all(t)
    req = admit(t, rows, "b", load=False)  # host hit ignored: all 20 tokens recomputed
    assert req.cache_protected_len == 0
    slots = rows.read(req.req_pool_idx, 0, 20).clone()  # type: ignore[arg-type]
    finish(t, rows, req)
    match = t.cache.match_prefix(PROMPT)
    assert match.prefix_len == 20 and torch.equal(match.device_indices, slots)  # adopted, not freed
    check_all(t)


def test_request_admitted_with_load_back_finishes_conserved() -> None:
    rows = ReqToTokenPool(4, 64, "cpu", strict=True)
    t = make_tiers("write_through", rows=rows)
    finish(t, rows, admit(t, rows, "a", load=False))
    before = read_device(t, t.cache.match_prefix(PROMPT).device_indices)
    demote_all(t)
    req = admit(t, rows, "b", load=True)
    assert req.cache_protected_len == 20
    for (k0, v0), (k1, v1) in zip(before, read_device(t, req.prefix_indices), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    check_all(t)
    finish(t, rows, req)
    assert t.cache.protected_size() == 0 and t.cache.evictable_size() == 20
    check_all(t)
