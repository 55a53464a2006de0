"""Named, parameterised components built from spec components (aggregators, attacks).

A component class has a kebab-case ``name``, takes ``f`` (how many Byzantine nodes the run
has) and keyword-only parameters with type hints; ``from_params`` checks a spec's parameter
names and types against that signature, and ``_check_param`` refuses bad values with a
message that says what the value must be.
"""

from __future__ import annotations

import inspect
import math
import typing
from typing import ClassVar, Generic, TypeVar

from .spec import Value

C = TypeVar("C", bound="Component")


class Component:
    """Base of every buildable component; ``f`` is the number of Byzantine nodes."""

    name: ClassVar[str]

    def __init__(self, f: int) -> None:
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"f must be a whole number >= 0 (got {f!r})")
        self.f = f

    def _check_param(self, key: str, value: float, ok: bool, rule: str) -> None:
        """Refuse a parameter that is not finite or fails ``ok``, saying what it must be."""
        if not ok or not math.isfinite(value):
            raise ValueError(f"{self.name} {key} must be {rule} (got {key}={value!r})")

    @classmethod
    def parameters(cls) -> dict[str, inspect.Parameter]:
        """The spec parameters of this component (its keyword-only ``__init__`` arguments)."""
        sig = inspect.signature(cls.__init__)
        return {k: p for k, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}

    @classmethod
    def from_params(cls: type[C], f: int, params: dict[str, Value]) -> C:
        """Build from parsed spec parameters, checking names and types against ``__init__``."""
        known = cls.parameters()
        hints = typing.get_type_hints(cls.__init__)
        kwargs = {}
        for key, value in params.items():
            if key not in known:
                listed = ", ".join(known) or "none"
                raise ValueError(f"{cls.name} has no parameter {key!r} (its parameters: {listed})")
            kwargs[key] = _coerce(cls.name, key, value, hints[key])
        return cls(f, **kwargs)


class Registry(Generic[C]):
    """The components of one family, by name."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.entries: dict[str, type[C]] = {}

    def register(self, cls: type[C]) -> type[C]:
        """Class decorator: make ``cls`` buildable under ``cls.name``."""
        if cls.name in self.entries:
            raise RuntimeError(f"two {self.family}s are named {cls.name!r}")
        self.entries[cls.name] = cls
        return cls

    def lookup(self, name: str, spec: str) -> type[C]:
        """The class named ``name``; unknown names list the choices."""
        if name not in self.entries:
            raise ValueError(
                f"unknown {self.family} {name!r} in {spec!r}: choose from {', '.join(sorted(self.entries))}"
            )
        return self.entries[name]

    def names(self) -> list[str]:
        return sorted(self.entries)


def _coerce(component: str, key: str, value: Value, annotation: object) -> Value:
    """``value`` as the type ``annotation`` names (``int``, ``float``, ``bool``, ``str``, ``X | None``)."""
    kinds = [k for k in typing.get_args(annotation) or (annotation,) if k is not type(None)]
    kind = kinds[0] if kinds else None
    if kind is float and type(value) is int:
        return float(value)
    if kind in (int, float, bool, str) and type(value) is not kind:
        raise ValueError(f"{component} parameter {key} must be {kind.__name__} (got {value!r})")
    return value
