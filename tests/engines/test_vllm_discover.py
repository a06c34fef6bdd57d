"""`kvscope attach`'s discovery and scrape on a real vLLM 0.32.0 server: the session's one server
(tests/engines/conftest.py), in the phase after the attach test, so the counters are read as what
two prompts add to them. (Was tests/attach/test_discover.py's engine test, with a server of its own.)"""

from __future__ import annotations

import httpx
import pytest

from kvscope.attach.discover import EngineInfo, discover
from kvscope.attach.scrape import scrape
from tests.attach.test_discover import wait_for
from tests.engines.conftest import InstrumentedVllm

pytestmark = pytest.mark.engines


def test_a_real_vllm_server_is_found_and_scraped(instrumented_vllm: InstrumentedVllm) -> None:
    server = instrumented_vllm.server
    url = server.url
    info = discover(url)
    assert info == EngineInfo("vllm", "0.32.0", server.model, 32, 384, None, ())
    before = scrape(url, info)
    prompt0, cached0, preempted0 = (
        int(v or 0) for v in (before.prompt_tokens_total, before.cached_tokens_total, before.preemptions_total)
    )
    assert (before.capacity_tokens, before.used_tokens, before.num_running) == (384, 0, 0)
    first = list(range(3, 103))  # NOTE: no other phase sends these tokens
    second = first[:64] + list(range(200, 236))  # shares two full 32-token blocks with the first
    for prompt in (first, second):
        answer = httpx.post(
            f"{url}/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": 1}, timeout=120
        )
        assert answer.status_code == 200, answer.text
    after = wait_for(lambda: scrape(url, info), lambda s: s.prompt_tokens_total == prompt0 + 200)
    assert (after.prompt_tokens_total, after.cached_tokens_total, after.preemptions_total) == (
        prompt0 + 200,
        cached0 + 64,
        preempted0,
    )
    assert (after.available_tokens, after.evictable_tokens, after.evicted_tokens_total) == (None, None, None)
