"""How each SGLang family reads the scheduler's live requests (LiveReader): the requests that own a row,
the tree node each one's prefix lock is on, a request's KV record and the tree's streaming sessions. The
census reads them (sglang_probe.py), and so do the hooks that run one (sglang_hooks.py's _census_hooks)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

from kvscope.probe.sglang_views import Holder, kv_span_0518, session_holders, session_holders_0518

_KV = operator.attrgetter("kv")  # NOTE: a request's KV record from 0.5.19 (LiveReader.kv_of)


class LiveReader(NamedTuple):
    """How a family reads the scheduler's live requests: `owners`, SGLang's invariant checker -> the
    requests that own a row; `lock_nodes`, those requests -> the tree node each one's prefix lock is on;
    `kv_of`, a request -> its KV record (req_pool_idx, cache_protected_len, kv_allocated_len: its own
    ReqKvInfo from 0.5.19, a KvSpan of what 0.5.18 keeps on the request); `sessions`, the tree -> its
    streaming sessions' records and the nodes they hold locked (sglang_views.session_holders)."""

    owners: Callable[[Any], list[Any]]
    lock_nodes: Callable[[list[Any]], list[Any]]
    kv_of: Callable[[Any], Any] = operator.attrgetter("kv")
    sessions: Callable[[Any], tuple[list[Holder], list[Any]]] = session_holders


def _requests_owning_rows(checker: Any) -> list[Any]:
    """The requests that own a row, as SGLang's invariant checker lists them (0.5.22 on)."""
    return list(checker._requests_owning_rows())


def _batch_owners(checker: Any) -> list[Any]:
    """The requests that own a row, read where SGLang's checker reads them before 0.5.22 had a method for
    it (its uncached count): the last batch's, the running batch's (when another object) and the chunked
    request parked between its chunks, each once, that holds a row."""
    last, running = checker.get_last_batch(), checker.get_running_batch()
    return _holders(last, running, [checker.get_chunked_req()])


def _batch_owners_0519(checker: Any) -> list[Any]:
    """_batch_owners for SGLang 0.5.19, whose checker reaches no chunked request: the one each batch was
    built with (ScheduleBatch.chunked_req, kept on the last batch after SGLang filters the request out of
    its reqs to run the next chunk)."""
    last, running = checker.get_last_batch(), checker.get_running_batch()
    batches = [b for b in (last, running) if b is not None]
    return _holders(last, running, [b.chunked_req for b in batches])


def _batch_owners_0518(checker: Any) -> list[Any]:
    """_batch_owners_0519 for SGLang 0.5.18, whose request holds a row while its own req_pool_idx is set
    (no ReqKvInfo.holds_kv: its ReqKvInfo is None until its first allocation and after its release)."""
    last, running = checker.get_last_batch(), checker.get_running_batch()
    batches = [b for b in (last, running) if b is not None]
    return _holders(last, running, [b.chunked_req for b in batches], _holds_row_0518)


def _holds_kv(req: Any) -> bool:
    return bool(req.kv.holds_kv)


def _holds_row_0518(req: Any) -> bool:
    return req.req_pool_idx is not None


def _holders(last: Any, running: Any, chunked: list[Any], holds: Callable[[Any], bool] = _holds_kv) -> list[Any]:
    """The requests of the last batch, the running batch (when another object) and `chunked`, each once,
    that hold a row (`holds`)."""
    reqs = [] if last is None else list(last.reqs)
    if running is not None and running is not last:  # NOTE: identity: ScheduleBatch's == compares tensors
        reqs += running.reqs
    reqs += [req for req in chunked if req is not None]
    owners: dict[int, Any] = {}
    for req in reqs:
        if holds(req):
            owners.setdefault(id(req), req)
    return list(owners.values())


def _lock_nodes(owners: list[Any]) -> list[Any]:
    """The node of each live request's tree lock (Req.lock, a TreeLock, 0.5.22 on; None: it holds none)."""
    return [lock.node for lock in (getattr(req, "lock", None) for req in owners) if lock is not None]


def _last_nodes(owners: list[Any]) -> list[Any]:
    """The node of each live request's tree lock before 0.5.22: its last_node, locked from its admission
    (PrefillAdder._req_inc_lock_ref), moved by cache_unfinished_req, unlocked at its release (unpin)."""
    return [req.last_node for req in owners if req.last_node is not None]


LIVE = LiveReader(_requests_owning_rows, _lock_nodes)
LIVE_0521 = LiveReader(_batch_owners, _last_nodes)  # NOTE: 0.5.20, 0.5.21: no _requests_owning_rows, no Req.lock
LIVE_0519 = LiveReader(_batch_owners_0519, _last_nodes)  # NOTE: no get_chunked_req on the checker
# NOTE: 0.5.18: a request's row and protected length on Req itself; a session slot's lock on its last_node
LIVE_0518 = LiveReader(_batch_owners_0518, _last_nodes, kv_span_0518, session_holders_0518)
