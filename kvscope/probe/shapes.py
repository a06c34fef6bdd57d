"""Support by shape: which family of an engine's code the installed release matches, read from the
code itself, not from its version string.

A hook target is described by what the probe needs of it (`Shape`): where it lives, the leading
parameters its wrapper passes or reads, and the attributes the probe reads on the owner's objects.
A `Family` is the shapes of one line of releases (named after its first release line, "0.34") with
the releases it was tested on, and the hook table built for it. `choose` picks the family to patch
with, or none:

    version tested in a family, every shape matches   -> that family, no extra line
    version tested in a family, a shape differs       -> none: "<engine> <version>: <target> <why>"
    version untested, a family's every shape matches  -> the newest such family, said in one line
    version untested, no family matches               -> none, naming the nearest family's first
                                                         differing target

NOTE: a shape check imports the engine's modules and reads signatures and code objects; it never
    calls the engine's code. It runs once, at load (or from `kvscope probe-check`).
"""

from __future__ import annotations

import dis
import importlib
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple


class Shape(NamedTuple):
    """What the probe needs of one target. `target` is "package.module.Class.method" (a method in the
    class's own namespace), "package.module.function", or "package.module.Class" (a class whose
    attributes the probe reads). `params`: the leading parameter names, in order (self included);
    trailing parameters the probe does not pass may be added by a release and still match. `reads`:
    attribute names the probe reads on the owner's objects (a class attribute, a slot, a dataclass
    field or a name the owner's `__init__` sets, along its MRO)."""

    target: str
    params: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()


class Family(NamedTuple):
    name: str  # the release line whose shapes these are, e.g. "0.34"
    releases: tuple[str, ...]  # releases the tests ran on
    shapes: tuple[Shape, ...]
    build: Callable[[], list[Any]]  # the engine's targets / hooks for this family


class Choice(NamedTuple):
    family: Family | None  # None: patch nothing
    line: str  # "" for a tested release that matches; else the one line to say

    @property
    def ok(self) -> bool:
        return self.family is not None


def shape_mismatch(shape: Shape) -> str | None:
    """Why the installed code differs from `shape` ("<target> <why>"), or None when it matches."""
    found = _resolve(shape.target)
    if isinstance(found, str):
        return f"{shape.target} {found}"
    owner, member = found
    if shape.params:
        why = _params_mismatch(member, shape.params)
        if why is not None:
            return f"{shape.target} {why}"
    missing = [name for name in shape.reads if not _has_attribute(owner, name)] if owner is not None else []
    if owner is not None and missing:
        return f"{shape.target}: {owner.__name__} has no attribute {', '.join(map(repr, missing))}"
    return None


def family_mismatches(family: Family) -> list[str]:
    return [why for why in map(shape_mismatch, family.shapes) if why is not None]


def choose(engine: str, version: str, families: Sequence[Family]) -> Choice:
    """The family to patch `engine` `version` with (families newest first), and the line to say."""
    tested = next((f for f in families if version in f.releases), None)
    if tested is not None:
        differs = family_mismatches(tested)
        if not differs:
            return Choice(tested, "")
        return Choice(None, f"{engine} {version}: {differs[0]}; nothing patched")
    scored = [(f, family_mismatches(f)) for f in families]
    for family, differs in scored:
        if not differs:
            return Choice(family, f"{engine} {version}: not tested; its shapes match family {family.name}")
    if not scored:
        return Choice(None, f"{engine} {version}: the probe knows no family of it; nothing patched")
    nearest, differs = min(scored, key=lambda pair: len(pair[1]))
    return Choice(
        None,
        f"{engine} {version}: not tested and matches no known family (nearest {nearest.name}: {differs[0]}); "
        "nothing patched",
    )


def describe(engine: str, version: str, families: Sequence[Family]) -> dict[str, Any]:
    """For `kvscope probe-check`: the choice and, for the chosen (else nearest) family, each target's
    shape and whether the installed code matches it."""
    choice = choose(engine, version, families)
    shown = choice.family or _nearest(families)
    return {
        "engine": engine,
        "version": version,
        "family": choice.family.name if choice.family else None,
        "tested": choice.family is not None and version in choice.family.releases,
        "loads": choice.ok,
        "line": choice.line,
        "families": [{"name": f.name, "releases": list(f.releases)} for f in families],
        "targets": [_shape_row(shape) for shape in (shown.shapes if shown else ())],
    }


def _nearest(families: Sequence[Family]) -> Family | None:
    return min(families, key=lambda f: len(family_mismatches(f)), default=None)


def _shape_row(shape: Shape) -> dict[str, Any]:
    why = shape_mismatch(shape)
    return {
        "target": shape.target,
        "params": list(shape.params),
        "reads": list(shape.reads),
        "match": why is None,
        "why": why,
    }


def _resolve(target: str) -> tuple[type | None, Any] | str:
    """(owner class or None, the member) of a target, or why it is not there."""
    found = _import_longest(target)
    if isinstance(found, str):
        return found
    obj, owner_path = found
    owner: type | None = None
    for part in owner_path:
        space = obj.__dict__ if isinstance(obj, (type, types.ModuleType)) else {}
        if part not in space:
            inherited = isinstance(obj, type) and hasattr(obj, part)
            where = obj.__name__.rpartition(".")[2]
            return f"not found ({where} {'inherits it' if inherited else 'has no ' + repr(part)})"
        owner = obj if isinstance(obj, type) else owner
        obj = space[part]
    if isinstance(obj, type):
        return obj, obj
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if not callable(obj):
        return "is not a function"
    return owner, obj


def _import_longest(target: str) -> tuple[types.ModuleType, list[str]] | str:
    """The longest importable module prefix of a dotted target and the names after it, or why none
    imports (a module that exists but fails to import is said as such, never raised)."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        tried = ".".join(parts[:cut])
        try:
            return importlib.import_module(tried), parts[cut:]
        except ModuleNotFoundError as err:
            if err.name and (tried == err.name or tried.startswith(err.name + ".")):
                continue  # NOTE: not a module (a class or function name), or the package is absent
            return f"cannot be imported (it needs {err.name!r}, not installed)"
        except Exception as err:  # NOTE: the engine's import error is a finding, never raised
            return f"cannot be imported ({type(err).__name__}: {err})".splitlines()[0]
    return "not found (no such module)"


def _params_mismatch(member: Any, wanted: tuple[str, ...]) -> str | None:
    try:
        names = tuple(inspect.signature(member).parameters)
    except (TypeError, ValueError):
        return "has no readable signature"
    if names[: len(wanted)] == wanted:
        return None
    return f"takes ({', '.join(names)}) where the probe needs ({', '.join(wanted)}, ...)"


def _has_attribute(owner: type, name: str) -> bool:
    return hasattr(owner, name) or any(name in names for names in _instance_names(owner))


def _instance_names(owner: type) -> Iterator[set[str] | tuple[str, ...] | dict[str, Any]]:
    """The names an instance of `owner` may carry, class by class along its MRO: slots, dataclass
    fields, annotations and every attribute its own methods set (`self.x = ...` in any of them, the
    functions they define included: an `__init__` often leaves the setting to helpers)."""
    for cls in owner.__mro__:
        yield tuple(getattr(cls, "__slots__", ()) or ())
        yield getattr(cls, "__dataclass_fields__", {})
        yield inspect.get_annotations(cls)
        codes = (getattr(member, "__code__", None) for member in cls.__dict__.values())
        yield {name for code in codes if code is not None for name in _stored_attributes(code)}


def _stored_attributes(code: types.CodeType) -> Iterator[str]:
    for instruction in dis.get_instructions(code):
        if instruction.opname == "STORE_ATTR":
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _stored_attributes(const)
