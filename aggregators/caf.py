"""Covariance-bound agnostic filter, CAF (Allouah, Guerraoui & Stephan, ICML 2025,
"Towards trustworthy federated learning with untrusted participants").

Weights ``c = 1``; while ``sum(c) > n - 2f``: ``mu_c = sum_i c_i x_i / sum(c)``,
``Sigma_c = sum_i c_i (x_i - mu_c)(x_i - mu_c)^T / sum(c)``; take its top eigenpair
``(lambda, v)``; remember ``mu_c`` if ``lambda`` is the smallest so far; then
``tau_i = ((x_i - mu_c) . v)^2`` and ``c_i <- c_i (1 - tau_i / max_{j: c_j > 0} tau_j)``.
Returns the remembered ``mu_c`` (the mean when f = 0). Needs ``n > 2f``.

Unlike the reference code, the max of tau runs over live rows only (there, a far outlier
whose weight is already 0 keeps the max and the loop can run forever), and the top eigenpair
is exact and deterministic, not one power-method step from an unseeded random vector: ``Sigma_c`` has the nonzero spectrum of the
``(n, n)`` matrix ``diag(sqrt c) K diag(sqrt c) / sum(c)``, with ``K`` the Gram matrix of the
rows centred at ``mu_c``, obtained from the squared distances ``D`` as
``K = -(D - D w 1^T - 1 w^T D + w^T D w) / 2`` with ``w = c / sum(c)``.
"""

from __future__ import annotations

import torch

from robust.geometry import sq_distances, weighted_sum
from .base import Rule, register


def caf_weights(dist: torch.Tensor, f: int) -> torch.Tensor:
    """Convex weights ``w`` of the CAF output ``sum_i w_i x_i``."""
    n = dist.shape[0]
    c = torch.ones(n, dtype=torch.float64, device=dist.device)
    best_w, best_lam = c / n, torch.inf
    while float(c.sum()) > n - 2 * f:
        w = c / c.sum()
        dw = dist @ w
        gram = -0.5 * (dist - dw[:, None] - dw[None, :] + w @ dw)
        root = c.sqrt()
        evals, evecs = torch.linalg.eigh(root[:, None] * gram * root[None, :] / c.sum())
        lam = float(evals[-1])
        if lam < best_lam:
            best_w, best_lam = w, lam
        # proportional to ((x_i - mu_c) . v)^2; rows already filtered out (c_i = 0) are left
        # out of the max, so every pass zeroes one live row and the loop ends within n passes
        tau = (gram @ (root * evecs[:, -1])).square() * (c > 0)
        if lam <= 0 or float(tau.max()) <= 0:
            break  # the weighted rows coincide: nothing left to filter
        c = c * (1.0 - tau / tau.max())
    return best_w


@register
class CAF(Rule):
    name = "caf"

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        w = caf_weights(sq_distances(X, exact=False), self.f)
        self.last_kept = w > 0
        return weighted_sum(X, w)
