"""The hit-oracle attacker of §1.7 T2 over HTTP: a real `kvscope serve` with two API keys of
different tenants; the attacker reads `usage.prompt_tokens_details.cached_tokens` and runs the
token-by-token search of tests/cache/scoped/attack_harness.py. With --cache scoped-radix
--promote-k inf it recovers 0 of 6; against --cache radix (global sharing), 6 of 6."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.cache.scoped.attack_harness import FILLER, PUBLIC_PREFIX, Attacker, recover
from tests.server.serving import Server, serving

MODEL = "kvscope-tiny"
KEYS = {"k-victim": {"tenant": "acme", "user": "alice"}, "k-attacker": {"tenant": "evil", "user": "mallory"}}
SECRET = (103, 107, 100, 109, 104, 101)
VICTIM_PROMPT = (*PUBLIC_PREFIX, *SECRET)


class HttpTarget:
    """Serves a prompt through the completions API; `user` names the API key to send it with."""

    def __init__(self, server: Server) -> None:
        self.clients = {key: server.client(key) for key in KEYS}

    def serve(self, prompt: Sequence[int], user: str) -> int:
        reply = self.clients[user].completions.create(model=MODEL, prompt=list(prompt), max_tokens=1)
        assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
        details = reply.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens is not None
        return details.cached_tokens


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("isolation")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    (tmp / "pinned.jsonl").write_text(json.dumps(list(PUBLIC_PREFIX)) + "\n")
    return tmp


@pytest.fixture
def scoped(files: Path) -> Iterator[Server]:
    with serving(
        None,
        "--cache",
        "scoped-radix",
        "--promote-k",
        "inf",
        "--pinned",
        str(files / "pinned.jsonl"),
        "--api-keys",
        str(files / "keys.json"),
    ) as srv:
        yield srv


@pytest.fixture
def shared(files: Path) -> Iterator[Server]:
    with serving(None, "--cache", "radix", "--api-keys", str(files / "keys.json")) as srv:
        yield srv


def attack(server: Server) -> tuple[tuple[int, ...], HttpTarget, Attacker]:
    """The victim's key sends P + secret; the attacker's key searches for the secret."""
    target = HttpTarget(server)
    assert target.serve(VICTIM_PROMPT, "k-victim") == 0
    attacker = Attacker(target, "k-attacker")
    return recover(attacker), target, attacker


def assert_controls(target: HttpTarget, attacker: Attacker) -> None:
    """The victim's repeat reports all but the last token cached; P is cached for the attacker."""
    assert target.serve(VICTIM_PROMPT, "k-victim") == len(VICTIM_PROMPT) - 1
    assert attacker.send((*PUBLIC_PREFIX, FILLER)) == len(PUBLIC_PREFIX)


def test_scoped_serve_hides_the_secret_from_another_tenant(scoped: Server) -> None:
    recovered, target, attacker = attack(scoped)
    assert recovered == ()
    assert len(attacker.sent) == 10  # the whole alphabet at the first position, and not one hit
    assert_controls(target, attacker)
    code, _ = scoped.stop()
    assert code == 0


def test_global_sharing_over_http_gives_the_secret_away(shared: Server) -> None:
    """The positive control: the same attack code against --cache radix recovers 6 of 6."""
    recovered, target, attacker = attack(shared)
    assert recovered == SECRET
    assert_controls(target, attacker)
    code, _ = shared.stop()
    assert code == 0
