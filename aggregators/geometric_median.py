"""Geometric median by smoothed Weiszfeld (Pillutla et al., IEEE TSP 2022, "Robust
aggregation for federated learning", RFA).

``F(X) = argmin_z sum_i max(nu, ||z - x_i||)`` (nu-smoothed), found by the iteration
``z <- sum_i beta_i x_i / sum_i beta_i`` with ``beta_i = 1 / max(nu, ||z - x_i||)``, from the
mean, until the objective's relative decrease is below ``tol`` (or ``max_iter`` iterations).

Every iterate is a convex combination ``z = sum_j w_j x_j``, so the iteration runs on the
weights alone with ``||z - x_i||^2 = (D w)_i - w^T D w / 2`` (D the squared-distance matrix,
~1e-6 relative error for float32 input): O(n^2) per iteration, one pass over ``X`` at the end. Needs ``n > 2f`` (its
breakdown point is 1/2).
"""

from __future__ import annotations

import logging

import torch

from robust.constraints import Interval, Param
from robust.geometry import sq_distances, weighted_sum
from .base import Rule, register

log = logging.getLogger(__name__)


def weiszfeld_weights(
    dist: torch.Tensor, nu: float, max_iter: int, tol: float
) -> tuple[torch.Tensor, bool]:
    """Weights ``w`` of the smoothed geometric median in the rows' convex hull, and convergence."""
    n = dist.shape[0]
    w = torch.full((n,), 1.0 / n, dtype=torch.float64, device=dist.device)
    previous = torch.inf
    for _ in range(max_iter):
        dw = dist @ w
        radii = (dw - 0.5 * (w @ dw)).clamp_min(0.0).sqrt().clamp_min(nu)
        objective = float(radii.sum())
        if previous - objective <= tol * objective:
            return w, True
        previous = objective
        beta = 1.0 / radii
        w = beta / beta.sum()
    return w, False


@register
class GeometricMedian(Rule):
    name = "geometric-median"
    uses_f = False

    params = (
        Param("nu", Interval(float, 0, None, "neither"), 1e-6, "smooths ||z - x_i|| near the data"),
        Param("max_iter", Interval(int, 1, None), 1000, "Weiszfeld iterations at most"),
        Param("tol", Interval(float, 0, None), 1e-10, "the relative objective decrease to stop at"),
    )

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        dist = sq_distances(X, exact=False)
        w, converged = weiszfeld_weights(dist, self.nu, self.max_iter, self.tol)
        if not converged:
            log.warning(
                "geometric-median did not reach tol=%g in %d iterations; raise max_iter",
                self.tol, self.max_iter,
            )
        return weighted_sum(X, w)
