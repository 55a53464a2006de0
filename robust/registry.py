"""Named, parameterised components built from spec components (aggregators, attacks, codecs).

A component class has a kebab-case ``name``, takes ``f`` (how many Byzantine nodes the run
has) and declares its spec parameters once, as data: ``params``, a tuple of
:class:`robust.constraints.Param` (type and range, default, meaning), and ``relations``
between them. A subclass inherits its bases' declarations and may redeclare a key (a new
default). ``Component.__init__`` checks every given value against them with
:func:`robust.constraints.check_all`, the one check and the one error format of the project,
and sets each as an attribute of the same name: a component never checks a parameter by
hand. What depends on the round (``n`` against ``f``) is checked when the round is known.

:meth:`Registry.describe` returns the declarations as plain data, from which the manual's
parameter reference is generated.
"""

from __future__ import annotations

import inspect
from typing import ClassVar, Generic, TypeVar

from .constraints import Param, Relation, check_all

C = TypeVar("C", bound="Component")


class Component:
    """Base of every buildable component; ``f`` is the number of Byzantine nodes."""

    name: ClassVar[str]
    params: ClassVar[tuple[Param, ...]] = ()  # this class's own; :meth:`declared` adds its bases'
    relations: ClassVar[tuple[Relation, ...]] = ()

    def __init__(self, f: int, **params: object) -> None:
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"f must be a whole number >= 0 (got {f!r})")
        self.f = f
        relations = [r for klass in type(self).__mro__ for r in vars(klass).get("relations", ())]
        for key, value in check_all(self.name, self.declared(), params, relations).items():
            setattr(self, key, value)

    @classmethod
    def declared(cls) -> dict[str, Param]:
        """Every spec parameter by key: the class's own first, then its bases' (a key
        redeclared by a subclass is the subclass's)."""
        out: dict[str, Param] = {}
        for klass in cls.__mro__:
            for p in vars(klass).get("params", ()):
                out.setdefault(p.key, p)
        return out


def entry(family: str, name: str, doc: str | None, params: dict[str, Param]) -> dict:
    """One component's reference, as data: its ``family``, ``name``, the first paragraph of
    its docstring (``summary``) and, per parameter, ``key``, ``allowed`` (the rule's words),
    ``default`` and ``help``."""
    summary = inspect.cleandoc(doc or "").split("\n\n")[0].replace("\n", " ")
    return {
        "family": family,
        "name": name,
        "summary": summary,
        "params": [{"key": p.key, "allowed": p.rule.describe(), "default": p.default, "help": p.help}
                   for p in params.values()],
    }


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

    def describe(self) -> list[dict]:
        """Every component's :func:`entry`, sorted by name (its docstring: the class's own, else
        its module's, where the paper and the formula are written)."""
        return [entry(self.family, name, vars(cls).get("__doc__") or inspect.getmodule(cls).__doc__, cls.declared())
                for name, cls in sorted(self.entries.items())]
