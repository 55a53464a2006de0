"""``gaussian:mu,sigma``: rows of Gaussian noise (Blanchard, El Mhamdi, Guerraoui & Stainer,
NeurIPS 2017, "Machine learning with adversaries: Byzantine tolerant gradient descent").

Every coordinate of every Byzantine row is drawn independently from the round's seeded
generator::

    X_byz[i, j] ~ N(mu, sigma^2)

The default ``sigma = 200`` is the paper's "Gaussian Byzantine workers" (with ``mu = 0``).
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param

from .base import Context, OmniscientAttack, register


@register
class Gaussian(OmniscientAttack):
    name = "gaussian"

    params = (
        Param("mu", Interval(float), 0.0, "the noise's mean"),
        Param("sigma", Interval(float, 0, None), 200.0, "the noise's standard deviation"),
    )

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        noise = torch.randn(self.f, H.shape[1], generator=ctx.generator, dtype=H.dtype)
        return (self.mu + self.sigma * noise).to(H.device)
