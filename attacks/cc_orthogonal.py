"""Relocated orthogonal perturbation, ROP (Özfatura, Özfatura, Küpçü & Gündüz,
"Byzantines can also learn from history: fall of centered clipping in federated learning",
arXiv:2208.09894), the attack on centered clipping.

Centered clipping clips each row to the radius ``tau`` around its center ``v``, the previous
aggregate, whatever the row's direction. So the Byzantine rows are *relocated* to the center
(not to the honest mean, where CC would clip them) and pushed just inside the radius, in a
direction orthogonal to where the honest nodes are going; clipping leaves them whole and the
aggregate moves by ``(f/n) radius tau p`` every round, always sideways. Every row is

    x = v + radius tau p,        p = sin(angle) o + cos(angle) u,
    u = ref / ||ref||,           ref = lam v + (1 - lam) mean(H),
    o = (1 - <1, u> u) / ||1 - <1, u> u||

``1`` the all-ones vector (the paper's: the same ``o`` round after round, so the sideways
moves add up). ``angle`` (degrees) 90 is orthogonal; beyond 90 the rows also pull back.
``lam`` weighs the center against the honest mean in the reference direction, as the
authors' code does (``lam=0``: orthogonal to the honest mean itself); the paper's other
knob, where the perturbation is placed between the honest mean and the center, is fixed at
the center, so the rows are never clipped. ``tau`` must match the deployed CC's (CC's
default, 10); ``radius=0.99, angle=90, lam=0.9`` are our defaults, its strongest measured
setting that stays unquarantined (``evaluation/scenarios/adaptive.toml``: the quick
scenario, 5 defences, seeds 0-3): 2.4 pp against CC (1.7 on average over the defences), no
node quarantined under any defence; ``angle=150,lam=0`` cost 2.5 against CC but some of
its nodes (1.25 of 5 on average) were quarantined under every defence, and ``angle``
120-180 or ``lam=0`` otherwise cost less. In the first round there is no previous
aggregate: CC's first center is zero, so ``v = 0`` and ``ref = mean(H)``, exactly what CC
does.
"""

from __future__ import annotations

import math

import torch

from robust.constraints import Interval, Param

from .base import Context, OmniscientAttack, register, unit


@register
class CCOrthogonal(OmniscientAttack):
    name = "cc-orthogonal"

    params = (
        Param("tau", Interval(float, 0, None, "neither"), 10.0, "the deployed centered clipping's radius"),
        Param("radius", Interval(float, 0, 1, "right"), 0.99, "the rows' distance to CC's center, in taus"),
        Param("angle", Interval(float, 0, 180), 90.0, "degrees from the reference direction"),
        Param("lam", Interval(float, 0, 1), 0.9, "the center's weight in the reference direction"),
    )

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        mean = H.mean(dim=0)
        if ctx.previous is None:
            center, ref = torch.zeros_like(mean), mean
        else:
            center = ctx.previous.to(H.device, H.dtype)
            ref = self.lam * center + (1 - self.lam) * mean
        u = unit(ref)
        ones = torch.ones_like(mean)
        o = unit(ones - (ones @ u) * u)
        a = math.radians(self.angle)
        return center + self.radius * self.tau * (math.sin(a) * o + math.cos(a) * u)
