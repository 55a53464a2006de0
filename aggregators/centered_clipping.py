"""Centered clipping (Karimireddy, He & Jaggi, ICML 2021, "Learning from history for
Byzantine robust optimization").

``v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||)``, repeated ``iters`` times. ``v``
starts at the previous call's output (zero at the first call), so the rule has state: use
one object per training run, ``reset()`` to forget it.

Every iterate is an affine combination ``v = a v_0 + sum_j w_j x_j`` (``a + sum_j w = 1``) of
the start ``v_0`` and the rows, so the iteration runs on the coefficients alone, with
``||y_i - v||^2 = (D c)_i - c^T D c / 2`` (``y = [x_1..x_n, v_0]``, ``D`` their squared
distances, ``c`` the coefficients): one pass over the rows for ``D``, one for the output,
whatever ``iters``.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.geometry import sq_distances, weighted_sum
from robust.source import Rows, stacked

from .base import Rule, register

F64 = torch.float64


def clipping_coefficients(dist: torch.Tensor, tau: float, iters: int) -> torch.Tensor:
    """The coefficients of ``iters`` centered-clipping steps over ``[x_1..x_n, v_0]`` from
    their ``(n+1, n+1)`` squared distances ``dist``."""
    n = dist.shape[0] - 1
    c = torch.zeros(n + 1, dtype=F64, device=dist.device)
    c[n] = 1.0
    for _ in range(iters):
        dc = dist @ c
        radius = (dc[:n] - 0.5 * (c @ dc)).clamp_min(0.0).sqrt()
        scale = torch.where(radius > tau, tau / radius, 1.0)
        # v + (1/n) sum_i s_i (x_i - v) = v (1 - sum(s)/n) + (1/n) sum_i s_i x_i
        c = c * (1.0 - float(scale.sum()) / n)
        c[:n] += scale / n
    return c


@register
class CenteredClipping(Rule):
    name = "centered-clipping"

    params = (
        Param("tau", Interval(float, 0, None, "neither"), 10.0, "the clipping radius"),
        Param("iters", Interval(int, 1, None), 1, "clipping steps per call, each from the last"),
    )

    def __init__(self, f: int, **params: object) -> None:
        super().__init__(f, **params)
        self.center: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the previous output: the next call starts from zero."""
        self.center = None

    def state(self) -> dict[str, torch.Tensor]:
        return {} if self.center is None else {"center": self.center}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.center = state.get("center")

    def aggregate(self, X: Rows) -> torch.Tensor:
        n, d = X.shape
        if self.center is not None and self.center.shape[0] != d:
            raise ValueError(
                f"centered-clipping last aggregated d={self.center.shape[0]} coordinates, "
                f"now d={d}: build a new aggregator (or reset()) for a new model"
            )
        start = torch.zeros(d, dtype=F64, device=X.device) if self.center is None else self.center
        points = stacked(X, start[None])
        c = clipping_coefficients(sq_distances(points), self.tau, self.iters)
        self.center = weighted_sum(points, c)
        return self.center.to(X.dtype)
