"""``gaussian:mu,sigma``: rows of Gaussian noise (Blanchard, El Mhamdi, Guerraoui & Stainer,
NeurIPS 2017, "Machine learning with adversaries: Byzantine tolerant gradient descent").

Every coordinate of every Byzantine row is drawn independently from the round's seeded
generator::

    X_byz[i, j] ~ N(mu, sigma^2)

The default ``sigma = 200`` is the paper's "Gaussian Byzantine workers" (with ``mu = 0``).
"""

from __future__ import annotations

import torch

from .base import Context, OmniscientAttack, register


@register
class Gaussian(OmniscientAttack):
    name = "gaussian"

    def __init__(self, f: int, *, mu: float = 0.0, sigma: float = 200.0) -> None:
        super().__init__(f)
        self._check_param("mu", mu, True, "a finite number")
        self._check_param("sigma", sigma, sigma >= 0, ">= 0: it is the noise's standard deviation")
        self.mu, self.sigma = mu, sigma

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        noise = torch.randn(self.f, H.shape[1], generator=ctx.generator, dtype=H.dtype)
        return (self.mu + self.sigma * noise).to(H.device)
