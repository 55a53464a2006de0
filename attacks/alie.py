"""A little is enough, ALIE (Baruch, Baruch & Goldberg, NeurIPS 2019).

Every Byzantine row is ``mean(H) - z * std(H)`` (per coordinate, population standard
deviation of the honest rows). Default ``z`` from the paper: with ``s = floor(n/2 + 1) - f``
supporters needed, ``z = Phi^-1((n - f - s) / (n - f))``; e.g. ``z(n=50, f=12) = 0.336``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import torch

from robust.constraints import Interval, Param

from .base import Context, OmniscientAttack, honest_std, register


def alie_z(n: int, f: int) -> float:
    """The paper's z for n nodes of which f are Byzantine (0 when no z helps)."""
    s = math.floor(n / 2 + 1) - f
    p = (n - f - s) / (n - f)
    return NormalDist().inv_cdf(p) if 0 < p < 1 else 0.0


def alie_rows(H: torch.Tensor) -> Callable[[float], torch.Tensor]:
    """``z -> mean(H) - z std(H)``, with the moments computed once (searches call it often)."""
    mean, std = H.mean(dim=0), honest_std(H)
    return lambda z: mean - z * std


@register
class ALIE(OmniscientAttack):
    name = "alie"

    params = (Param("z", Interval(float), None, "honest stds below the mean (default: the paper's z for n and f)"),)

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        return alie_rows(H)(self.z if self.z is not None else alie_z(ctx.n, self.f))
