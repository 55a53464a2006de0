"""What every aggregation rule and pre-aggregator shares: parameters, checks, the registry.

A *rule* maps a round's updates ``X`` of shape ``(n, d)`` to one ``(d,)`` aggregate; a
*pre-aggregator* maps ``X`` to a new ``(n', d)`` matrix handed to the next link of the chain.
Both are built from a spec component and validate their parameters in ``__init__``; the
number of rows they can serve is checked before any work is done.
"""

from __future__ import annotations

import inspect
import math
import typing
from typing import ClassVar

import torch

from robust.spec import Value

REGISTRY: dict[str, type[Stage]] = {}


def register(cls: type[Stage]) -> type[Stage]:
    """Class decorator: make ``cls`` buildable from a spec under ``cls.name``."""
    if cls.name in REGISTRY:
        raise RuntimeError(f"two aggregators are named {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls


class Stage:
    """Base of rules and pre-aggregators; ``f`` is the number of Byzantine rows tolerated."""

    name: ClassVar[str]
    is_rule: ClassVar[bool]

    def __init__(self, f: int) -> None:
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"f must be a whole number >= 0 (got {f!r})")
        self.f = f

    def check_n(self, n: int) -> None:
        """Raise ``ValueError`` if this stage cannot serve ``n`` rows with its ``f``."""

    def _check_param(self, key: str, value: float, ok: bool, rule: str) -> None:
        """Refuse a parameter that is not finite or fails ``ok``, saying what it must be."""
        if not ok or not math.isfinite(value):
            raise ValueError(f"{self.name} {key} must be {rule} (got {key}={value!r})")

    def _require(self, ok: bool, formula: str, n: int) -> None:
        if not ok:
            raise ValueError(
                f"{self.name} needs n {formula} (got n={n}, f={self.f}): lower f or add nodes"
            )

    @classmethod
    def parameters(cls) -> dict[str, inspect.Parameter]:
        """The spec parameters of this stage (its keyword-only ``__init__`` arguments)."""
        sig = inspect.signature(cls.__init__)
        return {k: p for k, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}

    @classmethod
    def from_params(cls, f: int, params: dict[str, Value]) -> Stage:
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


class Rule(Stage):
    """A final aggregation rule: ``(n, d) -> (d,)``."""

    is_rule = True

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PreAggregator(Stage):
    """A transformation applied before the rule: ``(n, d) -> (rows(n), d)``, same ``f``."""

    is_rule = False

    def rows(self, n: int) -> int:
        """How many rows this stage outputs for ``n`` input rows."""
        return n

    def transform(self, X: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """The transformed rows. ``inplace=True`` means ``X`` is an earlier stage's output,
        owned by the chain, and may be overwritten: a chain then never holds more than one
        extra copy of its input."""
        raise NotImplementedError


def check_updates(X: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``X`` is a finite float32/float64 matrix with n, d >= 1."""
    if not isinstance(X, torch.Tensor):
        raise ValueError(f"updates must be a torch.Tensor of shape (n, d) (got {type(X).__name__})")
    if X.dim() != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"updates must have shape (n, d) with n, d >= 1 (got {tuple(X.shape)})")
    if X.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"updates must be float32 or float64 (got {X.dtype}): convert with X.float()")
    # A row sum is finite only if the row is (inf and nan propagate); it may also overflow
    # for finite huge values, so only the rows it flags are checked exactly.
    suspects = (~torch.isfinite(X.sum(dim=1))).nonzero().flatten().tolist()
    bad = [i for i in suspects if not bool(torch.isfinite(X[i]).all())]
    if bad:
        raise ValueError(f"rows {bad} contain NaN or Inf: reject those updates before aggregation")


def _coerce(stage: str, key: str, value: Value, annotation: object) -> Value:
    """``value`` as the type ``annotation`` names (``int``, ``float``, ``bool``, ``str``, ``X | None``)."""
    kinds = [k for k in typing.get_args(annotation) or (annotation,) if k is not type(None)]
    kind = kinds[0] if kinds else None
    if kind is float and type(value) is int:
        return float(value)
    if kind in (int, float, bool, str) and type(value) is not kind:
        raise ValueError(f"{stage} parameter {key} must be {kind.__name__} (got {value!r})")
    return value
