"""The one spec grammar used by the CLI, config files and Python.

A spec is a chain of components joined by ``+``; each component is a kebab-case name with
optional inline parameters: ``name:key=value,key=value``. Example::

    bucketing:s=2,seed=7+centered-clipping:tau=10,iters=3

Values are read as ``true``/``false``, integers, floats, or else kept as strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
_KEY = re.compile(r"^[a-z_][a-z0-9_]*$")

Value = bool | int | float | str


@dataclass(frozen=True)
class Component:
    """One link of a spec chain: a name and its parameters."""

    name: str
    params: dict[str, Value] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_format_value(v)}" for k, v in self.params.items())


def parse(spec: str) -> list[Component]:
    """Parse ``spec`` into its components; raise ``ValueError`` saying what to fix."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty spec {spec!r}: give a name such as 'krum' or 'nnm+trimmed-mean'")
    return [_parse_component(part.strip(), spec) for part in spec.split("+")]


def format_spec(components: list[Component]) -> str:
    """The canonical text of a chain of components (inverse of :func:`parse`)."""
    return "+".join(str(c) for c in components)


def _parse_component(text: str, spec: str) -> Component:
    if not text:
        raise ValueError(f"empty component in spec {spec!r}: remove the doubled or trailing '+'")
    name, _, rest = text.partition(":")
    name = name.strip()
    if not _NAME.match(name):
        raise ValueError(
            f"bad name {name!r} in spec {spec!r}: names are kebab-case, e.g. 'trimmed-mean'"
        )
    params: dict[str, Value] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, raw = item.partition("=")
            key = key.strip()
            if not eq or not _KEY.match(key) or not raw.strip():
                raise ValueError(
                    f"bad parameter {item.strip()!r} of {name!r} in spec {spec!r}: "
                    "write key=value, e.g. 'krum' or 'multi-krum:m=5'"
                )
            if key in params:
                raise ValueError(
                    f"parameter {key!r} given twice to {name!r} in spec {spec!r}: keep one of them"
                )
            params[key] = _parse_value(raw.strip())
    return Component(name, params)


def _parse_value(raw: str) -> Value:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _format_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value).replace("e+", "e")  # '1e+16' would split the chain at '+'
    return str(value)
