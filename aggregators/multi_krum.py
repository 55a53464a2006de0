"""Multi-Krum (Blanchard et al., NeurIPS 2017; El Mhamdi et al., ICML 2018).

``F(X) = (1/m) sum_{i in M} x_i`` with ``M`` the ``m`` rows of smallest Krum score
(ties to the lower row index). Default ``m = n - f``. Needs ``n >= 2f + 3`` and
``1 <= m <= n``.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.geometry import sq_distances, weighted_sum
from .base import Rule, register
from .krum import krum_scores


@register
class MultiKrum(Rule):
    name = "multi-krum"

    params = (Param("m", Interval(int, 1, None), None, "how many rows to average (default n - f)"),)

    def check_n(self, n: int) -> None:
        self._require(n >= 2 * self.f + 3, ">= 2f + 3", n)
        if self.m is not None and self.m > n:
            raise ValueError(f"multi-krum m={self.m} exceeds the n={n} rows: lower m")

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        n = X.shape[0]
        m = self.m if self.m is not None else n - self.f
        scores = krum_scores(sq_distances(X), self.f)
        chosen = torch.sort(scores, stable=True).indices[:m]
        chosen_rows = torch.zeros(n, dtype=torch.float64, device=X.device)
        chosen_rows[chosen] = 1.0
        self.last_kept = chosen_rows > 0
        return weighted_sum(X, chosen_rows) / m
