"""Centered clipping (Karimireddy, He & Jaggi, ICML 2021, "Learning from history for
Byzantine robust optimization").

``v <- v + (1/n) sum_i (x_i - v) min(1, tau / ||x_i - v||)``, repeated ``iters`` times. ``v``
starts at the previous call's output (zero at the first call), so the rule has state: use
one object per training run, ``reset()`` to forget it.

Two kernels compute the same iteration (parity-tested), chosen by a cost fixed in advance, so
the bits depend on ``(n, iters)`` only, never on the machine:

- **By passes** (:func:`clip_by_passes`): each step reads the rows twice, once for the
  distances ``||x_i - v||`` (float64 differences, as ``robust.geometry.row_norms``) and once
  for the new ``v``: ``2 iters`` passes of O(n d).
- **By the Gram matrix** (:func:`clipping_coefficients`): every iterate is an affine
  combination ``v = a v_0 + sum_j w_j x_j`` of the start and the rows, so the iteration runs
  on the coefficients alone, with ``||y_i - v||^2 = (D c)_i - c^T D c / 2`` (``y = [x_1..x_n,
  v_0]``, ``D`` their squared distances, ``c`` the coefficients): one pass for ``D``, one for
  the output, whatever ``iters``; but ``D`` costs ``(n+1)^2 d`` products.

A Gram pass costs about ``n / GRAM_ROWS_PER_PASS`` plain passes (measured at n = 100, d = 1e6,
float64 on 2 cores: 277 ms against 35 ms), so the Gram kernel is taken when
``n + 1 < GRAM_ROWS_PER_PASS * (2 iters - 1)``: few rows and many steps (a bucketed round of 13
rows at ``iters=3``), and the passes otherwise (100 rows at ``iters=1``: two passes instead
of a 101-row Gram matrix).
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.geometry import row_norms, sq_distances, weighted_sum
from robust.source import Rows, stacked

from .base import Rule, register

F64 = torch.float64
GRAM_ROWS_PER_PASS = 12  # rows whose Gram pass costs one plain pass (see the module docstring)


def clip_by_passes(X: Rows, start: torch.Tensor | None, tau: float, iters: int) -> torch.Tensor:
    """``iters`` centered-clipping steps from ``start`` (float64 ``(d,)``; ``None``: zero),
    two passes over the rows a step; the last iterate in float64."""
    n = X.n
    v = start
    for _ in range(iters):
        radius = row_norms(X, center=v)
        scale = torch.where(radius > tau, tau / radius, 1.0)
        # v + (1/n) sum_i s_i (x_i - v) = v (1 - sum(s)/n) + (1/n) sum_i s_i x_i
        step = weighted_sum(X, scale / n, dtype=F64)
        v = step if v is None else step.add_(v, alpha=1.0 - float(scale.sum()) / n)
    return v


def clip_by_gram(X: Rows, start: torch.Tensor | None, tau: float, iters: int) -> torch.Tensor:
    """The same steps as :func:`clip_by_passes`, on the coefficients over ``[x_1..x_n, v_0]``:
    one pass for their squared distances, one for the output."""
    v0 = torch.zeros(X.d, dtype=F64, device=X.device) if start is None else start
    points = stacked(X, v0[None])
    return weighted_sum(points, clipping_coefficients(sq_distances(points), tau, iters))


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
    uses_f = False

    params = (
        Param("tau", Interval(float, 0, None, "neither"), 10.0, "the clipping radius", tune=True),
        Param("iters", Interval(int, 1, None), 1, "clipping steps per call, each from the last", tune=True),
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
        by_gram = n + 1 < GRAM_ROWS_PER_PASS * (2 * self.iters - 1)
        self.center = (clip_by_gram if by_gram else clip_by_passes)(X, self.center, self.tau, self.iters)
        return self.center.to(X.dtype)
