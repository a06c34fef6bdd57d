"""Cache kinds come from one registry (kvscope.engine.cache_kinds): the engine builds each kind
for the models it fits and refuses the others in one line, the CLI's choices and help are the
registry's, and the fault, host and scoped checks read its traits."""

from __future__ import annotations

from typing import get_args

import pytest

from kvscope.app.cli import POLICY_HELP, build_parser
from kvscope.cache import POLICIES, ChunkCache, RadixCache, ScopedRadixCache, SWAChunkCache, SWARadixCache
from kvscope.cache.hiradix import HiRadixCache
from kvscope.engine import CACHE_KINDS, CacheKind, cache_kind
from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig
from kvscope.engine.engine import Engine, check_faults
from kvscope.engine.faults import FaultSpec
from kvscope.engine.memory import HiMemorySystem, MemorySystem, SWAMemorySystem
from kvscope.engine.model import MODEL_PRESETS

BUILT = {  # (kind, model) -> (memory system, cache); a pair not here is refused
    ("radix", "tiny"): (MemorySystem, RadixCache),
    ("chunk", "tiny"): (MemorySystem, ChunkCache),
    ("none", "tiny"): (MemorySystem, ChunkCache),
    ("scoped-radix", "tiny"): (MemorySystem, ScopedRadixCache),
    ("hiradix", "tiny"): (HiMemorySystem, HiRadixCache),
    ("swa-radix", "tiny-swa"): (SWAMemorySystem, SWARadixCache),
    ("chunk", "tiny-swa"): (SWAMemorySystem, SWAChunkCache),
    ("none", "tiny-swa"): (SWAMemorySystem, SWAChunkCache),
}


def config(kind: str) -> EngineConfig:
    return EngineConfig(
        pool=PoolConfig(kv_size_tokens=256, max_running_requests=2, max_context_len=64),
        cache=CacheConfig(kind=kind),
        device="cpu",
    )  # type: ignore[arg-type]


def test_the_registry_names_the_kinds_the_config_type_allows() -> None:
    assert list(CACHE_KINDS) == list(get_args(CacheKind))


@pytest.mark.parametrize("kind", list(CACHE_KINDS))
@pytest.mark.parametrize("model", ["tiny", "tiny-swa"])
def test_each_kind_builds_for_the_models_it_fits_and_refuses_the_rest(kind: str, model: str) -> None:
    expected = BUILT.get((kind, model))
    if expected is None:
        with pytest.raises(ValueError, match=f"{kind}|{cache_kind(kind).label}") as refused:
            Engine(config(kind), MODEL_PRESETS[model])
        assert "\n" not in str(refused.value)
        return
    memory = Engine(config(kind), MODEL_PRESETS[model]).memory
    assert (type(memory), type(memory.cache)) == expected


def test_the_cli_reads_its_cache_choices_and_help_from_the_registry() -> None:
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    option = next(a for a in run._actions if "--cache" in a.option_strings)
    assert list(option.choices) == ["auto", *CACHE_KINDS]
    assert all(f"{name}: {spec.help}" in option.help for name, spec in CACHE_KINDS.items())


def test_the_policy_help_lists_the_registered_policies() -> None:
    """The parser cannot import the policies (kvscope.cache loads torch): its copy is held to them."""
    assert POLICY_HELP.split(", ") == list(POLICIES)


def test_fault_checks_read_the_traits() -> None:
    tree_kinds = [name for name, spec in CACHE_KINDS.items() if spec.has_tree]
    with pytest.raises(ValueError, match=r"needs a cache with a tree \((.*)\)") as refused:
        check_faults(config("chunk"), MODEL_PRESETS["tiny"], [FaultSpec.parse("lock-leak:1")])
    assert all(name in str(refused.value) for name in tree_kinds)
    with pytest.raises(ValueError, match=r"needs a host tier \(--cache hiradix\)"):
        check_faults(config("radix"), MODEL_PRESETS["tiny"], [FaultSpec.parse("host-leak:1")])
    check_faults(config("hiradix"), MODEL_PRESETS["tiny"], [FaultSpec.parse("host-leak:1")])
