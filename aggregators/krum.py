"""Krum (Blanchard et al., NeurIPS 2017, "Machine learning with adversaries").

``score_i = sum_{j in N_i} ||x_i - x_j||^2`` with ``N_i`` the ``n - f - 2`` rows nearest to
``x_i`` (itself excluded); ``F(X) = x_{i*}`` with ``i* = argmin_i score_i``, ties to the lowest
row index. Needs ``n >= 2f + 3``. Distances are exact (float64, centred; see ``robust.geometry``).
"""

from __future__ import annotations

import torch

from robust.geometry import sq_distances
from .base import Rule, register


def krum_scores(dist: torch.Tensor, f: int) -> torch.Tensor:
    """Krum score of every row of the squared-distance matrix ``dist`` (float64, ``(n,)``)."""
    n = dist.shape[0]
    k = max(n - f - 2, 0)
    others = dist + torch.diag(torch.full((n,), torch.inf, dtype=dist.dtype, device=dist.device))
    return torch.sort(others, dim=1).values[:, :k].sum(dim=1)


@register
class Krum(Rule):
    name = "krum"

    def check_n(self, n: int) -> None:
        self._require(n >= 2 * self.f + 3, ">= 2f + 3", n)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        best = int(torch.argmin(krum_scores(sq_distances(X), self.f)))
        self.last_kept = torch.arange(X.shape[0], device=X.device) == best
        return X.row(best)
