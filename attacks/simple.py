"""The baseline behaviours: honest Byzantine nodes, sign flip, Gaussian noise, infinities.

- ``none``: the Byzantine nodes send their own honest updates (the clean reference run).
- ``sign-flip``: every Byzantine row is ``-mean(H)``.
- ``gaussian:mu,sigma``: every coordinate drawn from ``N(mu, sigma^2)``, rows independent.
- ``inf``: rows of ``+inf``; validation must reject them before aggregation.
"""

from __future__ import annotations

import torch

from .base import Context, OmniscientAttack, register


@register
class NoAttack(OmniscientAttack):
    name = "none"

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        if ctx.own is None:
            raise ValueError("'none' sends the Byzantine nodes' own updates: pass them as Context.own")
        return ctx.own


@register
class SignFlip(OmniscientAttack):
    name = "sign-flip"

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        return -H.mean(dim=0)


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


@register
class Inf(OmniscientAttack):
    name = "inf"

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        return torch.full_like(H[0], torch.inf)
