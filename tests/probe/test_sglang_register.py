"""The SGLang probe's registration by level, without SGLang (the engine tests register it on SGLang's
real classes): level summary asks only for the per-batch, per-request and idle targets; a level that
is neither refuses in one line and patches nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvscope.probe import sglang as probe
from kvscope.probe import sglang_hooks, sglang_live, sglang_shapes
from kvscope.probe.sglang_shapes import shapes_of
from kvscope.probe.shapes import Family


@pytest.fixture(autouse=True)
def _no_refusal_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("KVSCOPE_CAPTURE", str(tmp_path / "never.db"))
    monkeypatch.setenv("KVSCOPE_PROBE_REFUSED", "1")  # NOTE: as in an engine's later process: no refusal run
    yield
    probe.PROBE.__init__(None, "")  # type: ignore[misc]


def _hook(original: Any, *args: Any, **kwargs: Any) -> Any:
    return original(*args, **kwargs)


def _table() -> list[probe.Hook]:
    return [
        probe.Hook("kvscope_nowhere.Pool.alloc", _hook, direct=True, per_op=True),
        probe.Hook("kvscope_nowhere.Batch.prepare_for_decode", _hook),
    ]


# NOTE: no shapes: the family matches whatever is installed, so the hooks' own resolution decides
FAMILIES = (Family("0.5.23", ("0.5.23",), (), _table),)


@pytest.mark.parametrize(("level", "missing"), [("full", "Pool.alloc, kvscope_nowhere.Batch"), ("summary", "Batch")])
def test_level_summary_needs_only_the_targets_it_hooks(
    monkeypatch: pytest.MonkeyPatch, level: str, missing: str
) -> None:
    monkeypatch.setenv("KVSCOPE_LEVEL", level)
    said = probe._register("0.5.23", FAMILIES)
    assert said.startswith(f"SGLang 0.5.23: kvscope_nowhere.{missing}.") and said.endswith("; nothing patched")
    assert not probe.PROBE.state.active


def test_without_kvscope_level_sglang_records_at_summary_and_leaves_the_per_operation_targets_alone(
    pool: type[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's default level is summary (full costs 2-3 µs per allocator or tree call on its real
    calls): its per-operation methods stay SGLang's."""
    monkeypatch.delenv("KVSCOPE_LEVEL", raising=False)
    family = sglang_shapes._family("0.5.23", ("0.5.23",), _pool_table, ())
    said = probe._register("0.5.23", (family,))
    assert said == "registered 0 hooks on SGLang 0.5.23 (level summary)"
    assert not hasattr(pool.alloc, "__wrapped__") and probe.PROBE.lean and probe.PROBE.state.active


def test_a_level_that_is_neither_refuses_and_patches_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVSCOPE_LEVEL", "verbose")
    said = probe._register("0.5.23", FAMILIES)
    assert said == "KVSCOPE_LEVEL must be summary or full, got 'verbose'; nothing patched"
    assert not probe.PROBE.state.active and capsys.readouterr().err.count("\n") == 1


def test_at_level_summary_the_allocators_and_trees_stay_sglangs() -> None:
    """Every hook on an allocator or tree operation (each direct patch, the HiCache component's) is
    full-only; summary keeps the batch, request, row and idle hooks."""
    kept = {h.target.rsplit(".", 2)[-2] + "." + h.target.rsplit(".", 1)[-1] for h in probe.hooks() if not h.per_op}
    assert kept == {
        "SWATokenToKVPoolAllocator.__init__",
        "ReqToTokenPool.alloc",
        "ReqToTokenPool.free_rows",
        "ScheduleBatch.prepare_for_extend",
        "ScheduleBatch.prepare_for_decode",
        "ScheduleBatch.retract_decode",
        "common.release_kv_cache",
        "Scheduler.on_idle",
        "Scheduler.event_loop_normal",
        "Scheduler.event_loop_overlap",
        "Scheduler.ingest_requests",
        "Scheduler.run_event_loop",
        "SchedulerInvariantChecker._report_leak",
        "SchedulerInvariantChecker._check_req_pool",
    }
    assert all(h.per_op for h in probe.hooks() if h.direct)


class Pool:
    """A stand-in allocator class whose method a direct hook patches (restored after each test)."""

    def alloc(self, need_size: int) -> int:
        return need_size


def _pool_table() -> list[probe.Hook]:
    return [probe.Hook(f"{__name__}.Pool.alloc", sglang_hooks._d_alloc, direct=True, per_op=True)]


@pytest.fixture
def pool() -> Iterator[type[Pool]]:
    original = Pool.__dict__["alloc"]
    yield Pool
    Pool.alloc = original  # type: ignore[method-assign]


def test_a_tested_release_whose_code_changed_shape_refuses_in_one_line_naming_the_target(
    pool: type[Pool], capsys: pytest.CaptureFixture[str]
) -> None:
    """The family's shape says alloc(self, need_size); the installed method takes (self, num_pages):
    one line names the target and why, and nothing is patched."""
    pool.alloc = lambda self, num_pages: num_pages  # type: ignore[method-assign,assignment,misc]
    family = sglang_shapes._family("0.5.23", ("0.5.23",), _pool_table, ())
    said = probe._register("0.5.23", (family,))
    assert said == (
        f"SGLang 0.5.23: {__name__}.Pool.alloc takes (self, num_pages) where the probe needs (self, need_size, ...); "
        "nothing patched"
    )
    assert capsys.readouterr().err == f"kvscope probe: {said}\n"
    assert not hasattr(pool.alloc, "__wrapped__") and not probe.PROBE.state.active


def test_an_untested_release_whose_shapes_match_a_family_loads_as_it_and_says_so(
    pool: type[Pool], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSCOPE_LEVEL", "full")
    gone = probe.Hook(f"{__name__}.Pool.gone", _hook)
    newer = sglang_shapes._family("0.5.23", ("0.5.23",), lambda: [*_pool_table(), gone], ())
    older = sglang_shapes._family("0.5.22", ("0.5.22",), _pool_table, ())
    said = probe._register("0.5.24", (newer, older))
    assert said == "registered 1 hooks on SGLang 0.5.24 (family 0.5.22, level full)"
    assert capsys.readouterr().err == "kvscope probe: SGLang 0.5.24: not tested; its shapes match family 0.5.22\n"
    assert pool.alloc.__wrapped__ is not None and probe.PROBE.state.active  # type: ignore[attr-defined]


def test_each_hooks_shape_holds_the_parameters_its_wrapper_passes() -> None:
    """A direct hook's shape is its method's every parameter (SGLang's must be the same); an AROUND
    hook's, those it names before its *args."""
    shapes = {s.target: s.params for s in shapes_of(probe.hooks())}
    assert shapes[f"{probe.UNIFIED}.evict_for_alloc"] == ("self", "params", "allocation_reclaim_satisfied")
    assert shapes[probe.RELEASE] == ("req", "tree_cache")
    assert shapes[f"{probe.ADDER}._commit_prefill_admission"] == ("self", "req")
    family_0522 = {s.target: s.params for s in shapes_of(probe.hooks_0522())}
    assert family_0522[f"{probe.UNIFIED}.evict_for_alloc"] == ("self", "params")
    family_0521 = {s.target: s.params for s in shapes_of(probe.hooks_0521())}
    assert family_0521[f"{probe.RADIX}.cache_unfinished_req"] == ("self", "req")  # no checkpoint before 0.5.22
    assert f"{probe.RADIX}.checkpoint" not in family_0521
    assert f"{probe.UNIFIED}.backup_kv_cache" in family_0521
    assert f"{probe.UNIFIED}.backup_kv_cache" not in {h.target for h in probe.hooks_0520()}
    family_0519 = {s.target: s.params for s in shapes_of(probe.hooks_0519())}
    assert family_0519[f"{probe.ADDER}.add_one_req"] == ("self", "req")  # no _commit_prefill_admission before 0.5.20
    assert f"{probe.ADDER}._commit_prefill_admission" not in family_0519
    assert family_0519[f"{probe.SCHEDULER}.process_input_requests"] == ("self",)  # the busy census's point
    assert f"{probe.SCHEDULER}.ingest_requests" not in family_0519
    assert family_0519[f"{probe.UNIFIED}.dec_lock_ref"] == ("self", "node_id", "params", "skip_swa")
    family_0518 = {s.target: s.params for s in shapes_of(probe.hooks_0518())}
    assert family_0518[f"{probe.ROWS}.free"] == ("self", "req")  # the row pool frees a request's own row
    assert f"{probe.ROWS}.free_rows" not in family_0518 and f"{probe.UNIFIED}.evict_for_alloc" not in family_0518
    assert [f.name for f in probe.FAMILIES] == ["0.5.23", "0.5.22", "0.5.21", "0.5.20", "0.5.19", "0.5.18"]


def test_probe_check_says_a_direct_method_with_one_parameter_more_than_the_probes_will_not_load(
    pool: type[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's alloc gained a trailing parameter: the shape (its leading parameters) still matches, but
    the probe's method would drop it, so the registration at level full refuses; describe_installed says
    the same."""
    monkeypatch.setenv("KVSCOPE_LEVEL", "full")
    pool.alloc = lambda self, need_size, hint=None: need_size  # type: ignore[method-assign,assignment,misc]
    family = sglang_shapes._family("0.5.23", ("0.5.23",), _pool_table, ())
    line = f"SGLang 0.5.23: {__name__}.Pool.alloc takes other parameters; nothing patched"
    described = probe.describe_installed("0.5.23", (family,))
    assert (described["loads"], described["family"], described["line"]) == (False, None, line)
    assert described["targets"][0]["match"]  # the shape alone matches
    assert probe._register("0.5.23", (family,)) == line and not hasattr(pool.alloc, "__wrapped__")


def test_probe_check_at_level_summary_loads_where_only_a_per_operation_method_changed(
    pool: type[Pool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same change at summary (SGLang's default): the method is not patched, so the probe loads, and
    describe_installed says so as _register does."""
    monkeypatch.delenv("KVSCOPE_LEVEL", raising=False)
    pool.alloc = lambda self, need_size, hint=None: need_size  # type: ignore[method-assign,assignment,misc]
    family = sglang_shapes._family("0.5.23", ("0.5.23",), _pool_table, ())
    described = probe.describe_installed("0.5.23", (family,))
    assert (described["loads"], described["family"], described["line"]) == (True, "0.5.23", "")
    assert probe._register("0.5.23", (family,)) == "registered 0 hooks on SGLang 0.5.23 (level summary)"


def test_probe_check_says_which_family_a_matching_release_loads_as(pool: type[Pool]) -> None:
    family = sglang_shapes._family("0.5.23", ("0.5.23",), _pool_table, ())
    described = probe.describe_installed("0.5.23", (family,))
    assert (described["loads"], described["family"], described["tested"], described["line"]) == (
        True,
        "0.5.23",
        True,
        "",
    )
    assert described["targets"] == [
        {"target": f"{__name__}.Pool.alloc", "params": ["self", "need_size"], "reads": [], "match": True, "why": None}
    ]
    assert "pages" in described["records"]


def test_the_0519_census_owners_take_the_chunked_request_a_batch_keeps_out_of_its_reqs() -> None:
    """SGLang 0.5.19's checker reaches no chunked request: the census's owners read it from the batch built
    with it (ScheduleBatch.chunked_req), which keeps it after SGLang filters it out of its reqs for its next
    chunk; a request that holds no row is none, and one in two places counts once."""
    from types import SimpleNamespace

    def req(rid: str, holds: bool = True) -> Any:
        return SimpleNamespace(rid=rid, kv=SimpleNamespace(holds_kv=holds))

    chunked, running_req, done = req("chunked"), req("decoding"), req("released", holds=False)
    last = SimpleNamespace(reqs=[done], chunked_req=chunked)
    running = SimpleNamespace(reqs=[running_req, chunked], chunked_req=None)
    checker = SimpleNamespace(get_last_batch=lambda: last, get_running_batch=lambda: running)
    assert [r.rid for r in sglang_live._batch_owners_0519(checker)] == ["decoding", "chunked"]
    running.reqs = [running_req]
    assert [r.rid for r in sglang_live._batch_owners_0519(checker)] == ["decoding", "chunked"]


class Tree:
    """A stand-in tree class whose insert a direct hook patches (restored after the test)."""

    def insert(self, params: Any) -> Any:
        return params


class OverridingTree(Tree):
    """Overrides the patched insert (as SGLang 0.5.18's HiRadixCache overrides RadixCache's)."""

    def insert(self, params: Any) -> Any:
        return super().insert(params)


class DerivedTree(Tree):
    """Derives from the tree and keeps its insert: the probe's."""


class WrappingTree:
    """Wraps a tree, not derived from it (as StreamingSession wraps a classic tree): calls the tree's own."""

    def __init__(self) -> None:
        self.inner = Tree()

    def insert(self, params: Any) -> Any:
        return self.inner.insert(params)


def test_a_tree_class_that_overrides_a_patched_method_is_named_once_and_no_other_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSCOPE_LEVEL", "full")  # NOTE: the tree's methods are patched at full only
    original = Tree.__dict__["insert"]
    try:
        family = sglang_shapes._family(
            "0.5.23",
            ("0.5.23",),
            lambda: [probe.Hook(f"{__name__}.Tree.insert", sglang_hooks._d_insert, direct=True, per_op=True)],
            (),
        )
        assert probe._register("0.5.23", (family,)).startswith("registered 1 hooks")
        unseen = probe.PROBE.tree_unseen
        assert (
            unseen(OverridingTree())
            == "OverridingTree.insert overrides the tree method the probe patched, so its calls go unseen"
        )
        assert unseen(OverridingTree()) is None  # NOTE: once per class
        assert unseen(Tree()) is None and unseen(DerivedTree()) is None and unseen(WrappingTree()) is None
    finally:
        Tree.insert = original  # type: ignore[method-assign]
