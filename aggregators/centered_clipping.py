"""Centered clipping (Karimireddy, He & Jaggi, ICML 2021, "Learning from history for
Byzantine robust optimization").

``v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||)``, repeated ``iters`` times. ``v``
starts at the previous call's output (zero at the first call), so the rule has state: use
one object per training run, ``reset()`` to forget it.
"""

from __future__ import annotations

import torch

from robust.geometry import row_norms, weighted_sum
from .base import Rule, register


@register
class CenteredClipping(Rule):
    name = "centered-clipping"

    def __init__(self, f: int, *, tau: float = 10.0, iters: int = 1) -> None:
        super().__init__(f)
        self._check_param("tau", tau, tau > 0, "> 0: it is the clipping radius")
        self._check_param("iters", iters, iters >= 1, ">= 1")
        self.tau, self.iters = tau, iters
        self.center: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the previous output: the next call starts from zero."""
        self.center = None

    def state(self) -> dict[str, torch.Tensor]:
        return {} if self.center is None else {"center": self.center}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.center = state.get("center")

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        n, d = X.shape
        if self.center is not None and self.center.shape[0] != d:
            raise ValueError(
                f"centered-clipping last aggregated d={self.center.shape[0]} coordinates, "
                f"now d={d}: build a new aggregator (or reset()) for a new model"
            )
        v = (
            torch.zeros(d, dtype=torch.float64, device=X.device)
            if self.center is None
            else self.center.to(device=X.device, dtype=torch.float64)
        )
        for _ in range(self.iters):
            radius = row_norms(X, v)
            scale = torch.where(radius > self.tau, self.tau / radius, 1.0)
            # v + (1/n) sum_i c_i (x_i - v) = v (1 - sum(c)/n) + (1/n) sum_i c_i x_i
            v = v * (1.0 - float(scale.sum()) / n) + weighted_sum(X, scale / n).to(torch.float64)
        self.center = v
        return v.to(X.dtype)
