"""64 concurrent streams through a real `kvscope serve`: every one completes, the server's tokens
are the engine's own on the same prompts (`kvscope run`'s code path, in-process), and after
SIGTERM the capture holds every request and its idle leak checks balance."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from kvscope.app.cli import build_parser
from kvscope.app.runner import engine_from_args
from kvscope.workloads.tokenizer import ByteTokenizer
from tests.server.serving import Server, serving
from tests.server.test_serve_e2e import MODEL

NUM_STREAMS = 64
MAX_TOKENS = 8
SHARED = "You are a careful assistant. Answer in one short sentence. "


def prompts() -> list[str]:
    """Half share a system prefix (the radix cache matches it), half do not."""
    return [(SHARED if i % 2 else "") + f"question {i}: what is {i} + {i * 7}?" for i in range(NUM_STREAMS)]


async def stream_all(url: str, texts: list[str]) -> list[tuple[str, str | None, int]]:
    """(text, finish_reason, completion_tokens) of each prompt, all streamed at once."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

    async def one(i: int, prompt: str) -> tuple[str, str | None, int]:
        parts, finish, usage = [], None, 0
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            stream=True,
            user=f"user-{i % 4}",
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.text)
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return "".join(parts), finish, usage

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(texts))))
    finally:
        await client.close()


def engine_texts(texts: list[str]) -> list[str]:
    """The same prompts through the engine in-process, configured as the server is."""
    from kvscope.engine import Engine, Req

    engine, model = engine_from_args(build_parser().parse_args(["serve", "--kv-tokens", "4096", "--device", "cpu"]))
    tokenizer = ByteTokenizer()
    requests = [Req(f"r{i}", np.asarray(tokenizer.encode(t), dtype=np.int32), MAX_TOKENS) for i, t in enumerate(texts)]
    Engine(engine, model).run(requests)
    return [tokenizer.decode(req.output_ids) for req in requests]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("many") / "serve.db") as srv:
        yield srv


def test_64_concurrent_streams_complete_with_the_engines_tokens(server: Server) -> None:
    texts = prompts()
    results = asyncio.run(stream_all(server.url, texts))
    assert [(finish, used) for _, finish, used in results] == [("length", MAX_TOKENS)] * NUM_STREAMS
    assert [text for text, _, _ in results] == engine_texts(texts)
    code, printed = server.stop()
    assert code == 0 and "Traceback" not in printed, printed
    conn = sqlite3.connect(f"file:{server.capture}?mode=ro", uri=True)
    try:
        (status,) = conn.execute("SELECT status FROM runs").fetchone()
        rows = conn.execute("SELECT status, output_len, principal FROM requests").fetchall()
        checks = conn.execute("SELECT step, ok FROM leak_checks ORDER BY step").fetchall()
        (last_finish,) = conn.execute("SELECT max(finish_step) FROM requests").fetchone()
    finally:
        conn.close()
    assert status == "finished"
    assert len(rows) == NUM_STREAMS and {r[0] for r in rows} == {"finished"} and {r[1] for r in rows} == {MAX_TOKENS}
    assert {r[2] for r in rows} == {f"user-{i}" for i in range(4)}
    assert checks and all(ok for _, ok in checks) and checks[-1][0] >= last_finish
