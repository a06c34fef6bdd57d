"""A small hand-computed fleet written with the real SQL recorder (shared by the fleet tests).

NOTE: the fleet "f1" (page size 2; tokens as written)
    rank 0 (round robin's and affinity's requests)   root -> [1 2 3 4] -> [5 6]
    rank 1                                           root -> [1 2] -> [3 4 7 8]
    pages   rank 0: (12) (12|34) (1234|56)   rank 1: (12) (12|34) (1234|78)
    held 6 + 6 = 12 tokens, unique 8 (four distinct pages), duplicated 4 ((12) and (12|34) twice)
    routing round_robin: loss 4 (q1: 4 - 0) + 4 (q3: 6 - 2) = 8 of 20 prompt tokens = 0.4
            prefix_affinity: q2 routed 6 elsewhere 2: loss 0 of 8
    usage   rank 0: 30 of 100 in use, hit 6 of 18;  rank 1: 50 of 100, hit 0 of 15
    leaks   rank 0: ok, idle floor 4;  rank 1: 2 tokens held at idle (leak), floor 10
A second fleet "old" has snapshots without page hashes, and a third run belongs to no fleet.
"""

from __future__ import annotations

from pathlib import Path

from kvscope.telemetry import LeakCheck, NodeRow, PoolTerms, RequestRecord, Routing, SQLRecorder, UsageSample
from kvscope.telemetry.page_hash import PAGE_HASH_BYTES, chained_digests

PAGE_TOKENS = 2


def tokens_bytes(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def hashes_of(path_before: list[int], tokens: list[int]) -> bytes:
    """The node's page_hashes after the full path `path_before` (page-aligned)."""
    page_bytes = PAGE_TOKENS * 4
    parent = chained_digests(tokens_bytes(path_before), page_bytes, None)
    digests = chained_digests(tokens_bytes(tokens), page_bytes, parent[-1] if parent else None)
    return b"".join(d[:PAGE_HASH_BYTES] for d in digests)


def node(node_id: int, parent: int | None, path_before: list[int], tokens: list[int], hashed: bool = True) -> NodeRow:
    blob = (hashes_of(path_before, tokens) if tokens else b"") if hashed else None
    return NodeRow(
        node_id, parent, len(tokens), "", 0, 0.0, 0, None, False, len(path_before) + len(tokens), page_hashes=blob
    )


def usage(step: int, available: int, evictable: int, prompt: int, hit: int) -> UsageSample:
    return UsageSample(step, PoolTerms(100, available, evictable, 0), None, 8, 8, 1, 2, prompt, hit, 2, 1, 3, 0)


def write_replica(
    path: Path, config: dict, trees: list[NodeRow], sample: UsageSample, check: LeakCheck, requests: list[RequestRecord]
) -> None:
    with SQLRecorder(path, config=config) as rec:
        rec.step = 1
        rec.usage(sample._replace(step=1))
        rec.tree_snapshot(1, trees)
        rec.step = 2
        rec.usage(sample)
        rec.leak_check(check)
        for request in requests:
            rec.request(request)


def request(rid: str, prompt_len: int, routing: Routing | None) -> RequestRecord:
    return RequestRecord(rid, None, prompt_len, status="finished", routing=routing)


def write_fleet(path: Path) -> None:
    fleet = {"id": "f1", "size": 2, "dispatch": "round_robin"}
    write_replica(
        path,
        {"fleet": {**fleet, "rank": 0}},
        [node(0, None, [], []), node(1, 0, [], [1, 2, 3, 4]), node(2, 1, [1, 2, 3, 4], [5, 6])],
        usage(2, 60, 10, 18, 6),
        LeakCheck(2, "full", 100, 90, 6, 0, 4, 0),
        [
            request("q1", 10, Routing("round_robin", 0, 4)),
            request("q2", 8, Routing("prefix_affinity", 6, 2)),
        ],
    )
    write_replica(
        path,
        {"fleet": {**fleet, "rank": 1}},
        [node(0, None, [], []), node(1, 0, [], [1, 2]), node(2, 1, [1, 2], [3, 4, 7, 8])],
        usage(2, 40, 10, 15, 0),
        LeakCheck(2, "full", 100, 88, 2, 0, 8, 0),
        [request("q3", 10, Routing("round_robin", 2, 6)), request("q4", 5, None)],
    )
    old = {"id": "old", "size": 1, "dispatch": "round_robin"}
    write_replica(
        path,
        {"fleet": {**old, "rank": 0}},
        [node(0, None, [], [], hashed=False), node(1, 0, [], [1, 2], hashed=False)],
        usage(2, 60, 10, 18, 6),
        LeakCheck(2, "full", 100, 90, 10, 0, 0, 0),
        [],
    )
    write_replica(path, {}, [], usage(2, 60, 10, 18, 6), LeakCheck(2, "full", 100, 90, 10, 0, 0, 0), [])
