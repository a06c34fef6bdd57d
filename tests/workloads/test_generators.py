"""Properties every workload generator has: seeded, in range, well-formed, timed on request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvscope.workloads import WORKLOADS, ByteTokenizer, generate, read_trace, write_trace

NAMES = sorted(WORKLOADS)
NUM_SPECIAL = ByteTokenizer.num_special
EOS_ID = ByteTokenizer.eos_id


def test_registry_has_the_six_workloads() -> None:
    assert set(WORKLOADS) == {"shared-prefix", "multi-turn", "few-shot", "branching", "random", "multi-tenant"}


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_gives_the_same_requests(name: str) -> None:
    assert generate(name, num_requests=40, seed=7) == generate(name, num_requests=40, seed=7)


@pytest.mark.parametrize("name", NAMES)
def test_different_seeds_give_different_prompts(name: str) -> None:
    first = generate(name, num_requests=40, seed=0)
    second = generate(name, num_requests=40, seed=1)
    assert any(not np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("vocab_size", [NUM_SPECIAL + 5, 512])
@pytest.mark.parametrize("name", NAMES)
def test_token_ids_are_in_range_and_never_special(name: str, vocab_size: int) -> None:
    requests = generate(name, num_requests=60, seed=3, vocab_size=vocab_size)
    ids = np.concatenate(
        [r.prompt_ids for r in requests] + [r.output_ids for r in requests if r.output_ids is not None]
    )
    assert ids.dtype == np.int32
    assert ids.min() >= NUM_SPECIAL and ids.max() < vocab_size, (ids.min(), ids.max())
    assert EOS_ID not in ids


@pytest.mark.parametrize("name", NAMES)
def test_requests_are_well_formed(name: str) -> None:
    requests = generate(name, num_requests=50, seed=2)
    assert len(requests) == 50
    assert len({r.rid for r in requests}) == 50, "request ids repeat"
    assert all(r.user for r in requests), "every generator names a user"
    assert all(r.arrival_s is None for r in requests)
    assert all(1 <= r.output_len <= 32 and 16 <= r.prompt_len <= 400 for r in requests)
    assert generate(name, num_requests=0) == []


@pytest.mark.parametrize("name", NAMES)
def test_rate_gives_poisson_arrivals_without_changing_tokens(name: str) -> None:
    rate_per_s = 4.0
    timed = generate(name, num_requests=400, seed=5, rate_per_s=rate_per_s)
    untimed = generate(name, num_requests=400, seed=5)
    arrivals = np.array([r.arrival_s for r in timed])
    assert arrivals[0] > 0 and np.all(np.diff(arrivals) > 0)
    mean_gap_s = arrivals[-1] / len(arrivals)
    assert 0.8 / rate_per_s < mean_gap_s < 1.2 / rate_per_s, mean_gap_s
    for a, b in zip(timed, untimed, strict=True):
        assert np.array_equal(a.prompt_ids, b.prompt_ids) and a.rid == b.rid


@pytest.mark.parametrize("name", NAMES)
def test_generated_trace_round_trips_through_a_file(name: str, tmp_path: Path) -> None:
    requests = generate(name, num_requests=30, seed=4, rate_per_s=10.0)
    path = tmp_path / f"{name}.jsonl"
    write_trace(path, requests)
    assert read_trace(path, vocab_size=512) == requests


def test_unknown_workload_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'; valid names: shared-prefix, multi-turn") as exc:
        generate("nope", num_requests=1)
    assert all(name in str(exc.value) for name in NAMES)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("shared-prefix", {"output_len": 0}, "output_len must be an int >= 1, got 0"),
        ("random", {"num_requests": -1}, "num_requests must be an int >= 0, got -1"),
        ("few-shot", {"examples_per_prompt": 7}, r"examples_per_prompt \(7\) must be <= num_examples \(6\)"),
        ("branching", {"rate_per_s": 0.0}, "rate_per_s must be a finite number > 0 or None, got 0.0"),
        ("multi-turn", {"vocab_size": NUM_SPECIAL}, f"vocab_size must be an int >= {NUM_SPECIAL + 1}"),
        ("multi-tenant", {"seed": -1}, "seed must be an int >= 0, got -1"),
    ],
)
def test_bad_options_are_rejected_with_the_value(name: str, options: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"num_requests": 5, **options}
    with pytest.raises(ValueError, match=message):
        generate(name, **arguments)


def test_an_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="system_prompt_len"):
        generate("random", num_requests=3, system_prompt_len=4)
