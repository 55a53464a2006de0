"""PoisonedFL (Xie, Fang & Gong, "Model poisoning attacks to federated learning via
multi-round consistency", CVPR 2025, arXiv:2404.15611).

The Byzantine nodes push the model the same way every round, so that pushes small enough to
pass a defence add up instead of cancelling. One random sign vector ``s`` in ``{-1, +1}^d``
is drawn once (from the first attacked round's generator) and kept; every Byzantine row is

    g_t = lambda_t  s * v_t,        lambda_t = c_t ||a||,
    v_t = |r| / ||r||,              r = a - ||a|| g_{t-1} / ||g_{t-1}||

with ``a`` the previous aggregate (the model's last move, in row units; the honest rows'
mean in the first attacked round, when there is none) and ``g_{t-1}`` the attack's own
previous row: the magnitude vector ``v_t`` shares the row's norm among coordinates as the
last move did once the attackers' own direction is taken out of it. No honest row is needed
for the direction.

``c_t`` adapts (the paper's check, every ``period`` aggregates): if the signs of the
aggregates summed over the period agree with ``s`` on fewer than ``k_99(d)`` coordinates,
the 99% quantile of Binomial(d, 1/2) (``d/2 + 2.326 sqrt(d)/2``, the normal approximation),
the model is not moving along ``s`` better than chance and ``c <- decay c``, unless that
would take ``c`` below ``floor``. Defaults ``period=50, decay=0.7, floor=0.5`` are the
reference implementation's; ``scale`` (``c_0``) is in row units here (the reference measures
the model's move in parameter units, learning rate included), default 0.5: rows half as long
as the last aggregate, the strongest measured (``evaluation/scenarios/adaptive.toml``: the
quick scenario, 5 defences, seeds 0-3): 14.2 pp on average over the defences (68.3 against
Krum, under 1 against the others), where ``scale`` 1 cost 10.7, 2 (the former default, rows
about as long as an honest row) -0.2 and 4 0.3; 0.25 (with ``floor=0.25``) cost 14.1. At
0.5 the scale sits on its floor, so it never decays.
A new coalition (after a quarantine) draws a new ``s``.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from robust.constraints import Interval, Param, Relation

from .base import Context, OmniscientAttack, register, unit

K99 = NormalDist().inv_cdf(0.99)  # one-sided 99% quantile of the standard normal


@register
class PoisonedFL(OmniscientAttack):
    name = "poisoned-fl"

    params = (
        Param("scale", Interval(float, 0, None, "neither"), 0.5, "the rows' norm in units of the last aggregate's"),
        Param("period", Interval(int, 1, None), 50, "aggregates between two checks of the scale"),
        Param("decay", Interval(float, 0, 1, "neither"), 0.7, "the factor a failed check shrinks the scale by"),
        Param("floor", Interval(float, 0, None, "neither"), 0.5, "the scale never shrinks below it"),
    )
    relations = (Relation("floor", "<= scale", "scale", lambda v: v["floor"] <= v["scale"]),)

    def __init__(self, f: int, **params: object) -> None:
        super().__init__(f, **params)
        self.c = self.scale  # the current scale, shrunk by failed checks
        self.sign: torch.Tensor | None = None  # s, fixed for the run
        self.last: torch.Tensor | None = None  # g_{t-1}
        self.total: torch.Tensor | None = None  # the aggregates of the current period, summed
        self.seen = 0  # aggregates in it

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        d = H.shape[1]
        if self.sign is None or self.sign.shape[0] != d:
            self.sign = torch.randint(0, 2, (d,), generator=ctx.generator).to(H.device, H.dtype) * 2 - 1
            self.last, self.total, self.seen = None, None, 0
        a = H.mean(dim=0) if ctx.previous is None else ctx.previous.to(H.device, H.dtype)
        if ctx.previous is not None:
            self._check(a)
        r = a if self.last is None else a - a.norm() * unit(self.last)
        self.last = self.c * a.norm() * self.sign * unit(r.abs())
        return self.last

    def _check(self, aggregate: torch.Tensor) -> None:
        """Count the aggregate into the period; at its end shrink ``c`` if the model did not
        follow ``s`` better than chance."""
        self.total = aggregate.clone() if self.total is None else self.total + aggregate
        self.seen += 1
        if self.seen < self.period:
            return
        d = self.total.shape[0]
        agree = int((torch.sign(self.total) == self.sign).sum())
        if agree < d / 2 + K99 * math.sqrt(d) / 2 and self.decay * self.c >= self.floor:
            self.c *= self.decay
        self.total, self.seen = None, 0
