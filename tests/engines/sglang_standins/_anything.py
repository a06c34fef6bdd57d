"""The one object every stand-in module hands out for any name: callable (as a decorator it returns
what it decorates), subscriptable, an attribute holder and a base class. Import-only: SGLang's memory
classes never call into it on the CPU (a call that decides a slot would be a test bug, not a stand-in)."""

from __future__ import annotations

import sys
import types
from typing import Any


class Anything:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._name = "anything"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # a decorator: the function stays itself
        return Anything()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()

    def __getitem__(self, key: Any) -> Any:
        return Anything()

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (AnythingBase,)

    def __bool__(self) -> bool:
        return False

    def __iter__(self) -> Any:
        return iter(())

    def __or__(self, other: Any) -> Any:
        return Anything()

    __ror__ = __or__


class _AnythingType(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()


class AnythingBase(metaclass=_AnythingType):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """A field of a stand-in class in a pydantic model (xgrammar's StructuralTag in SGLang's request
        models) takes any value."""
        from pydantic_core import core_schema

        return core_schema.any_schema()


def standin(name: str, **names: Any) -> types.ModuleType:
    """A module `name` whose every missing attribute is an Anything (submodules too)."""
    module = types.ModuleType(name)
    module.__dict__.update(names)
    module.__path__ = []  # type: ignore[attr-defined]  # NOTE: a package: `import name.sub` works
    module.__getattr__ = lambda attr: _attr(name, attr)  # type: ignore[method-assign]
    sys.modules[name] = module
    return module


SUBMODULES = {"runtime", "language", "backends", "compiler", "testing", "tools"}
NO_DRIVER = {"triton.runtime": "driver"}  # NOTE: asked for the active GPU, there is none (callers fall back)


def _attr(module: str, attr: str) -> Any:
    if attr.startswith("__"):
        raise AttributeError(attr)
    if NO_DRIVER.get(module) == attr:
        raise RuntimeError("no GPU driver (an import-only stand-in)")
    if attr in SUBMODULES:
        return sys.modules.get(f"{module}.{attr}") or standin(f"{module}.{attr}")
    if attr.lstrip("_")[:1].isupper():  # NOTE: a class name: isinstance() and subclassing need a real type
        return _AnythingType(attr, (AnythingBase,), {})
    return Anything()
