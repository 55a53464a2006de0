"""What every aggregation rule and pre-aggregator shares: parameters, checks, the registry.

A *rule* maps a round's updates ``X`` of shape ``(n, d)`` to one ``(d,)`` aggregate; a
*pre-aggregator* maps ``X`` to a new ``(n', d)`` matrix handed to the next link of the chain.
Both are built from a spec component and validate their parameters in ``__init__``; the
number of rows they can serve is checked before any work is done.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from robust.registry import Component, Registry

REGISTRY: Registry[Stage] = Registry("aggregator")
register = REGISTRY.register


class Stage(Component):
    """Base of rules and pre-aggregators; ``f`` is the number of Byzantine rows tolerated."""

    is_rule: ClassVar[bool]

    def check_n(self, n: int) -> None:
        """Raise ``ValueError`` if this stage cannot serve ``n`` rows with its ``f``."""

    def state(self) -> dict[str, torch.Tensor]:
        """What this stage carries from one call to the next (checkpointed with the model)."""
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state` returned."""

    def _require(self, ok: bool, formula: str, n: int) -> None:
        if not ok:
            raise ValueError(
                f"{self.name} needs n {formula} (got n={n}, f={self.f}): lower f or add nodes"
            )


class Rule(Stage):
    """A final aggregation rule: ``(n, d) -> (d,)``.

    Rules that select rows (Krum, Multi-Krum, Bulyan, MDA, CAF) record in ``last_kept`` which
    rows of their last input they used (bool ``(n,)``), so detectors can score "discarded".
    """

    is_rule = True
    last_kept: torch.Tensor | None = None

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PreAggregator(Stage):
    """A transformation applied before the rule: ``(n, d) -> (rows(n), d)``, same ``f``."""

    is_rule = False
    keeps_rows: ClassVar[bool] = True  # output row i still stands for input row i alone

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
