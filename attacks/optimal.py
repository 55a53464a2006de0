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

from robust.constraints import Interval, Param, Relation

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

    params = (
        Param("lo", Interval(float, 0, None, "neither"), 1e-2, "the weakest strength searched (on a log scale)"),
        Param("hi", Interval(float, 0, None, "neither"), 1e2, "the strongest strength searched"),
        Param("steps", Interval(int, 2, None), 9, "strengths on the log grid"),
        Param("refine", Interval(int, 0, None), 6, "golden-section steps around the grid's best"),
    )
    relations = (Relation("hi", "> lo", "lo", lambda v: v["hi"] > v["lo"]),)

    def __init__(self, f: int, **params: object) -> None:
        super().__init__(f, **params)
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
