"""`kvscope serve --cache hiradix`: a conversation pushed off the device by others comes back
from the host tier, the completion is the same token for token as when it was computed cold,
the client sees the host hit as cached tokens, /metrics labels it cache_source="host" as SGLang
does (so `kvscope attach`'s scrape reads it), and the capture holds both tiers and checks clean."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from kvscope.attach.discover import discover
from kvscope.attach.scrape import EngineSample, scrape
from kvscope.telemetry import EventKind
from kvscope.telemetry.queries import Capture
from tests.server.serving import serving

MODEL = "kvscope-tiny"
KV_TOKENS = 600  # a few conversations fit; eight do not


def conversation(i: int) -> str:
    return f"Conversation {i}: a long opening that is the same on every turn of this chat. " * 3


def idle_sample(url: str, timeout_s: float = 30.0) -> EngineSample:
    """One scrape once no request runs or waits, and one stats interval later."""
    info = discover(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if scrape(url, info).num_running == scrape(url, info).num_waiting == 0:
            time.sleep(1.0)
            return scrape(url, info)
        time.sleep(0.2)
    raise AssertionError("the server did not go idle")


def test_a_conversation_evicted_to_host_comes_back_equal(tmp_path: Path) -> None:
    capture = tmp_path / "serve.db"
    with serving(
        capture, "--cache", "hiradix", "--kv-tokens", str(KV_TOKENS), "--host-ratio", "4", "--level", "full"
    ) as server:
        client = server.client()
        first = client.completions.create(model=MODEL, prompt=conversation(0), max_tokens=6, temperature=0)
        for i in range(1, 8):  # the others push conversation 0 off the device (its copy stays on the host)
            client.completions.create(model=MODEL, prompt=conversation(i), max_tokens=6, temperature=0)
        again = client.completions.create(model=MODEL, prompt=conversation(0), max_tokens=6, temperature=0)
        sample = idle_sample(server.url)
        code, _ = server.stop()
    assert code == 0
    assert again.choices[0].text == first.choices[0].text
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached > again.usage.prompt_tokens // 2
    with sqlite3.connect(capture) as conn:
        loaded, hits, host_hits, host_total = conn.execute(
            "SELECT MAX(cum_loaded_tokens), MAX(cum_hit_tokens), MAX(cum_host_hit_tokens), MAX(host_total) FROM usage"
        ).fetchone()
    evicts = Capture(capture).events(1, kinds=[EventKind.EVICT], limit=None, columns=["reason"])
    evicted_to_host = int((evicts.reason == "to-host").sum())
    assert evicted_to_host > 0 and loaded >= host_hits
    assert cached // 2 < host_hits <= cached  # most of the revisited conversation came back from the host
    assert host_total >= 4 * KV_TOKENS
    assert (sample.cached_tokens_total, sample.host_cached_tokens_total) == (hits, host_hits)
    check = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", str(capture)], capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr
