"""Optimal IPM and ALIE: the strength that does the most damage to the deployed defence.

For ``optimal-ipm`` (rows ``-eps * mean(H)``) and ``optimal-alie`` (rows
``mean(H) - z * std(H)``) the strength is chosen each round to maximise the damage
``||F([H; B(s)]) - mean(H)||`` against the aggregator chain ``F`` actually deployed: a
log-spaced grid of ``steps`` strengths in ``[lo, hi]``, then ``refine`` golden-section steps
around the best grid point (as ByzFL's optimal variants, with the real chain in the loop).
The chosen strength is kept in ``last_strength``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .alie import alie_rows
from .base import Context, OmniscientAttack, register
from .ipm import ipm_rows

GOLDEN = (math.sqrt(5) - 1) / 2


def search_strength(
    H: torch.Tensor, ctx: Context, f: int, row: Callable[[float], torch.Tensor],
    lo: float, hi: float, steps: int, refine: int,
) -> float:
    """The strength in ``[lo, hi]`` whose row does the most damage to ``ctx``'s aggregator."""
    mean = H.mean(dim=0)

    def damage(log_s: float) -> float:
        B = row(math.exp(log_s)).expand(f, -1)
        return float(torch.linalg.vector_norm(ctx.aggregate(torch.cat([H, B])) - mean))

    grid = torch.linspace(math.log(lo), math.log(hi), steps).tolist()
    scores = [damage(g) for g in grid]
    best = max(range(steps), key=lambda i: (scores[i], -i))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, steps - 1)]
    found = (scores[best], grid[best])
    for _ in range(refine):  # golden section on log-strength between the best's neighbours
        c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
        dc, dd = damage(c), damage(d)
        found = max(found, (dc, c), (dd, d))
        if dc >= dd:
            b = d
        else:
            a = c
    return math.exp(found[1])


class OptimalStrength(OmniscientAttack):
    """Shared parameters and search of the optimal attacks."""

    def __init__(
        self, f: int, *, lo: float = 1e-2, hi: float = 1e2, steps: int = 9, refine: int = 6
    ) -> None:
        super().__init__(f)
        self._check_param("lo", lo, lo > 0, "> 0: the search runs on a log scale")
        self._check_param("hi", hi, hi > lo, f"> lo={lo}")
        self._check_param("steps", steps, steps >= 2, ">= 2")
        self._check_param("refine", refine, refine >= 0, ">= 0")
        self.lo, self.hi, self.steps, self.refine = lo, hi, steps, refine
        self.last_strength: float | None = None

    def rows(self, H: torch.Tensor) -> Callable[[float], torch.Tensor]:
        """``strength -> Byzantine row`` for this round's honest rows."""
        raise NotImplementedError

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        row = self.rows(H)
        self.last_strength = search_strength(
            H, ctx, self.f, row, self.lo, self.hi, self.steps, self.refine
        )
        return row(self.last_strength)


@register
class OptimalIPM(OptimalStrength):
    name = "optimal-ipm"

    def rows(self, H: torch.Tensor) -> Callable[[float], torch.Tensor]:
        return ipm_rows(H)


@register
class OptimalALIE(OptimalStrength):
    name = "optimal-alie"

    def rows(self, H: torch.Tensor) -> Callable[[float], torch.Tensor]:
        return alie_rows(H)
