"""The soak's clients, in a process of their own (tests/engines/test_vllm_soak.py starts it), so that
pytest's threads and GIL never slow the traffic down.

    python -m tests.engines.soak_traffic CONFIG_JSON LOG     (stops when its stdin closes)

CONFIG_JSON (see Traffic): the server's url and model, the requests' id prefix and seed, the number of
short clients and of anchors, the short requests' output lengths and each anchor's.
- A short client sends its next completion as soon as its last one ended: distinct prompts, a third of
  them on one of three shared 64-token prefixes (prefix hits).
- An anchor is a relay of long streamed requests: the next one is sent once the last one streamed half
  its tokens, so an anchor always has a request in the engine with half its tokens or more still to
  decode. The engine is out of work only if the API server hands over nothing for that long.
Every line of LOG is one JSON object: {"t", "client", "status"} per answer, {"t", "client", "error"}
per transport error, and {"t", "anchors_closed": true} once stdin closed and every anchor's stream
was closed (vLLM aborts a request whose client left). The short clients then end the request they
are in and stop. "t" is time.monotonic(), the system's monotonic clock, as the capture's.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

PREFIXES = 3
PREFIX_TOKENS = 64
VOCAB = 512  # NOTE: the test model's vocab_size (tests/engines/vllm_server.py)
ANCHOR_PROMPT = 40
RETRY_S = 0.5  # NOTE: after a transport error (a dead server answers at once)
JOIN_S = 130.0  # NOTE: a short request's time out is 120 s


def completion_body(model: str, prompt: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
    """A soak request: greedy, exactly `max_tokens` long (the soak's clients and its test's own requests)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # NOTE: random weights may pick EOS at once
        "temperature": 0,
        "stream": stream,
    }


@dataclass
class Traffic:
    url: str
    model: str
    rid_prefix: str
    seed: int
    clients: int  # short ones
    min_tokens: int
    max_tokens: int
    anchor_tokens: list[int] = field(default_factory=list)  # one anchor per length
    log: TextIO = sys.stdout
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, **line: Any) -> None:
        with self.lock:
            self.log.write(json.dumps({"t": time.monotonic(), **line}) + "\n")
            self.log.flush()

    def short(self, i: int) -> None:
        rng = random.Random(self.seed * 100 + i)
        prefixes = [[random.Random(p).randrange(3, VOCAB) for _ in range(PREFIX_TOKENS)] for p in range(PREFIXES)]
        with httpx.Client(timeout=120) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                head = rng.choice(prefixes) if rng.random() < 1 / 3 else []
                size = rng.randrange(70 if head else 40, 100)  # NOTE: 99 + 150 < 256
                prompt = head + tokens(rng, size - len(head))
                length = rng.randrange(self.min_tokens, self.max_tokens)
                rid = f"{self.rid_prefix}-{i}-{n}"
                try:
                    response = client.post(
                        f"{self.url}/v1/completions",
                        headers={"X-Request-Id": rid},
                        json=completion_body(self.model, prompt, length),
                    )
                    self.note(client=i, status=response.status_code)
                except httpx.HTTPError as err:
                    self.note(client=i, error=f"{type(err).__name__}: {err}")
                    self.stop.wait(RETRY_S)

    def anchor(self, i: int) -> None:
        """Client `i`'s relay: each request's half-way point sends the next."""
        rng = random.Random(self.seed * 100 + i)
        length = self.anchor_tokens[i - self.clients]
        readers: list[threading.Thread] = []
        n = 0
        while not self.stop.is_set():
            n += 1
            half = threading.Event()
            args = (i, f"{self.rid_prefix}-{i}-{n}", tokens(rng, ANCHOR_PROMPT), length, half)
            readers = [r for r in readers if r.is_alive()] + [threading.Thread(target=self.stream, args=args)]
            readers[-1].start()
            while not half.wait(0.2) and not self.stop.is_set():
                pass
        for reader in readers:
            reader.join(JOIN_S)

    def stream(self, i: int, rid: str, prompt: list[int], length: int, half: threading.Event) -> None:
        """One anchor request, read until it ends or the traffic stops; `half` is set once it streamed
        half its tokens (or ended, or failed)."""
        body = completion_body(self.model, prompt, length, stream=True)
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", headers={"X-Request-Id": rid}, json=body, timeout=120
            ) as response:
                for line in response.iter_lines():
                    if self.stop.is_set():
                        break
                    if streamed(line) * 2 >= length:
                        half.set()
            self.note(client=i, status=response.status_code)
        except httpx.HTTPError as err:
            self.note(client=i, error=f"{type(err).__name__}: {err}")
            self.stop.wait(RETRY_S)
        finally:
            half.set()

    def run(self, stdin: TextIO) -> None:
        shorts = [threading.Thread(target=self.short, args=(i,), daemon=True) for i in range(self.clients)]
        anchors = [
            threading.Thread(target=self.anchor, args=(self.clients + a,), daemon=True)
            for a in range(len(self.anchor_tokens))
        ]
        for thread in shorts + anchors:
            thread.start()
        stdin.read()  # NOTE: until the test closes it
        self.stop.set()
        for thread in anchors:
            thread.join(JOIN_S)
        self.note(anchors_closed=True)
        for thread in shorts:
            thread.join(JOIN_S)


def streamed(line: str) -> int:
    """The completion tokens a streamed chunk says were generated so far (0 for other lines)."""
    if not line.startswith("data: {"):
        return 0
    usage = json.loads(line.removeprefix("data: ")).get("usage") or {}
    return int(usage.get("completion_tokens") or 0)


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(count)]


def main(argv: list[str]) -> int:
    config, log = json.loads(argv[0]), Path(argv[1])
    with log.open("a") as out:
        Traffic(**config, log=out).run(sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
