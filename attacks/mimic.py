"""Mimic (Karimireddy, He & Jaggi, ICLR 2022, "Byzantine-robust learning on heterogeneous
datasets via bucketing").

All Byzantine nodes copy one honest node, over-representing its data. The node is the one
with the largest projection on the honest updates' top principal direction ``z``, estimated
over the first ``warmup`` rounds by an online power method:
``z <- normalise(t/(t+1) z + 1/(t+1) sum_i (h_i - mu) <h_i - mu, z>)``; after the warm-up the
choice is fixed. ``mimic:node=i`` always copies honest row ``i``.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param

from .base import Context, OmniscientAttack, register


@register
class Mimic(OmniscientAttack):
    name = "mimic"

    params = (
        Param("node", Interval(int, 0, None), None, "the index of the honest row to copy (default: tracked)"),
        Param("warmup", Interval(int, 1, None), 20, "rounds the direction is tracked before a row is chosen"),
    )

    def __init__(self, f: int, **params: object) -> None:
        super().__init__(f, **params)
        self.direction: torch.Tensor | None = None
        self.rounds_seen = 0
        self.target: int | None = None

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        if self.node is not None:
            if self.node >= H.shape[0]:
                raise ValueError(f"mimic node={self.node} but there are {H.shape[0]} honest rows: lower node")
            return H[self.node]
        if self.target is None or self.rounds_seen < self.warmup:
            self.target = self._track(H, ctx)
        return H[min(self.target, H.shape[0] - 1)]

    def _track(self, H: torch.Tensor, ctx: Context) -> int:
        """One power-method step on this round's honest covariance; the current best node."""
        centred = (H - H.mean(dim=0)).to(torch.float64)
        if self.direction is None or self.direction.shape[0] != H.shape[1]:
            z = torch.randn(H.shape[1], generator=ctx.generator, dtype=torch.float64)
            self.direction, self.rounds_seen = z / z.norm(), 0
        t = self.rounds_seen
        step = centred.T @ (centred @ self.direction)
        z = t / (t + 1) * self.direction + step / (t + 1)
        self.direction = z / z.norm().clamp_min(1e-300)
        self.rounds_seen += 1
        return int(torch.argmax(centred @ self.direction))
