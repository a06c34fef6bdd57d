"""Support by shape (kvscope/probe/shapes.py) on real modules written to disk: a release whose code
matches a family loads with it, one that differs refuses naming the target, and an untested
release loads only when a family's every shape matches."""

from __future__ import annotations

import itertools
import sys
import textwrap
from pathlib import Path

import pytest

from kvscope.probe.shapes import Family, Shape, choose, describe, shape_mismatch

_COUNTER = itertools.count()

OLD_POOL = """
    class KVCacheBlock:
        __slots__ = ("block_id", "ref_cnt")

    class BlockPool:
        cache_kind = "hash"

        def __init__(self, num_gpu_blocks, enable_caching):
            self.blocks = []
            self.free_block_queue = None
            self._made = [self._helper() for _ in range(0)]

        def _helper(self):
            self.cached_block_hash_to_block = {}

        def free_blocks(self, ordered_blocks):
            return None

        def touch(self, blocks):
            return None
"""

# NOTE: the next release adds a trailing parameter (still the probe's shape) and renames touch's
NEW_POOL = """
    class KVCacheBlock:
        __slots__ = ("block_id", "ref_cnt")

    class BlockPool:
        def __init__(self, num_gpu_blocks, enable_caching, medium=None):
            self.blocks = []
            self.free_block_queue = None

        def free_blocks(self, ordered_blocks, medium=None):
            return None

        def touch(self, block_ids):
            return None
"""


def _engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool: str) -> str:
    """A package `fakeengineN` (fresh name per test) with core/block_pool.py holding `pool`."""
    name = f"fakeengine{next(_COUNTER)}"
    core = tmp_path / name / "core"
    core.mkdir(parents=True)
    (tmp_path / name / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "block_pool.py").write_text(textwrap.dedent(pool))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    return f"{name}.core.block_pool"


def _families(module: str) -> list[Family]:
    new = Family(
        "0.34",
        ("0.34.0",),
        (
            Shape(f"{module}.BlockPool.touch", ("self", "block_ids")),
            Shape(f"{module}.BlockPool.free_blocks", ("self", "ordered_blocks")),
            Shape(f"{module}.BlockPool.__init__", ("self", "num_gpu_blocks", "enable_caching", "medium")),
        ),
        lambda: ["new table"],
    )
    old = Family(
        "0.32",
        ("0.32.0", "0.33.0"),
        (
            Shape(f"{module}.BlockPool.touch", ("self", "blocks")),
            Shape(f"{module}.BlockPool.free_blocks", ("self", "ordered_blocks")),
            Shape(f"{module}.BlockPool", reads=("blocks", "free_block_queue", "cached_block_hash_to_block")),
            Shape(f"{module}.KVCacheBlock", reads=("ref_cnt",)),
        ),
        lambda: ["old table"],
    )
    return [new, old]


def test_a_tested_release_that_matches_its_family_loads_without_a_line(tmp_path, monkeypatch):
    families = _families(_engine(tmp_path, monkeypatch, OLD_POOL))
    choice = choose("vLLM", "0.32.0", families)
    assert choice.ok and choice.family is families[1] and choice.line == ""
    assert choice.family.build() == ["old table"]


def test_a_tested_release_whose_code_changed_refuses_naming_the_target(tmp_path, monkeypatch):
    module = _engine(tmp_path, monkeypatch, NEW_POOL)
    choice = choose("vLLM", "0.33.0", _families(module))
    assert not choice.ok
    assert choice.line == (
        f"vLLM 0.33.0: {module}.BlockPool.touch takes (self, block_ids) where the probe needs (self, blocks, ...); "
        "nothing patched"
    )


def test_an_untested_release_loads_with_the_newest_family_that_matches_and_says_so(tmp_path, monkeypatch):
    families = _families(_engine(tmp_path, monkeypatch, NEW_POOL))
    choice = choose("vLLM", "0.35.0", families)
    assert choice.family is families[0]
    assert choice.line == "vLLM 0.35.0: not tested; its shapes match family 0.34"


def test_an_untested_release_matching_no_family_names_the_nearest_familys_first_difference(tmp_path, monkeypatch):
    module = _engine(tmp_path, monkeypatch, OLD_POOL.replace("def touch(self, blocks)", "def touch(self, ids)"))
    choice = choose("vLLM", "0.29.0", _families(module))
    assert not choice.ok
    assert choice.line == (
        "vLLM 0.29.0: not tested and matches no known family (nearest 0.32: "
        f"{module}.BlockPool.touch takes (self, ids) where the probe needs (self, blocks, ...)); nothing patched"
    )


def test_attributes_are_found_in_slots_class_attributes_and_the_init_and_its_helpers(tmp_path, monkeypatch):
    module = _engine(tmp_path, monkeypatch, OLD_POOL)
    assert shape_mismatch(Shape(f"{module}.BlockPool", reads=("cache_kind", "cached_block_hash_to_block"))) is None
    assert shape_mismatch(Shape(f"{module}.KVCacheBlock", reads=("block_id",))) is None
    assert shape_mismatch(Shape(f"{module}.KVCacheBlock", reads=("block_hash", "ref_cnt"))) == (
        f"{module}.KVCacheBlock: KVCacheBlock has no attribute 'block_hash'"
    )


def test_missing_modules_classes_inherited_methods_and_broken_imports_are_findings(tmp_path, monkeypatch):
    module = _engine(
        tmp_path,
        monkeypatch,
        OLD_POOL + "\n    class Child(BlockPool):\n        pass\n",
    )
    package = module.rsplit(".", 1)[0]
    (tmp_path / package.replace(".", "/") / "broken.py").write_text("import not_installed_anywhere\n")
    (tmp_path / package.replace(".", "/") / "failing.py").write_text("raise RuntimeError('no GPU')\n")
    assert shape_mismatch(Shape(f"{module}.Gone.touch")) == f"{module}.Gone.touch not found (block_pool has no 'Gone')"
    assert shape_mismatch(Shape(f"{module}.Child.touch")) == f"{module}.Child.touch not found (Child inherits it)"
    assert shape_mismatch(Shape(f"{package}.absent.Thing.go")) == (
        f"{package}.absent.Thing.go not found (core has no 'absent')"
    )
    assert shape_mismatch(Shape(f"{package}.broken.Thing.go")) == (
        f"{package}.broken.Thing.go cannot be imported (it needs 'not_installed_anywhere', not installed)"
    )
    assert shape_mismatch(Shape(f"{package}.failing.Thing.go")) == (
        f"{package}.failing.Thing.go cannot be imported (RuntimeError: no GPU)"
    )
    absent = "no_such_engine_pkg.mod.Cls.m"
    assert shape_mismatch(Shape(absent)) == f"{absent} not found (no such module)"
    assert shape_mismatch(Shape(f"{module}.BlockPool.cache_kind")) == f"{module}.BlockPool.cache_kind is not a function"


def test_describe_lists_every_target_of_the_chosen_family_with_its_match(tmp_path, monkeypatch):
    module = _engine(tmp_path, monkeypatch, NEW_POOL)
    report = describe("vLLM", "0.33.0", _families(module))
    assert report["loads"] is False and report["family"] is None and report["tested"] is False
    assert [row["target"] for row in report["targets"]] == [
        f"{module}.BlockPool.touch",
        f"{module}.BlockPool.free_blocks",
        f"{module}.BlockPool.__init__",
    ]
    assert [row["match"] for row in report["targets"]] == [True, True, True]  # NOTE: the nearest family is 0.34
    assert describe("vLLM", "0.34.0", _families(module))["tested"] is True
