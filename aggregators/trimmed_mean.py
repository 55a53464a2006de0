"""Coordinate-wise trimmed mean (Yin et al., ICML 2018).

Per coordinate, drop the f largest and the f smallest values and average the rest:
``F(X)_j = 1/(n-2f) sum_{k=f+1}^{n-f} x_(k)j`` with ``x_(k)j`` the k-th smallest value.
Needs ``n > 2f``. Sums run over the sorted values in float64, so the result is bitwise the
same for any order of the rows.
"""

from __future__ import annotations

import torch

from ._columns import reduce_sorted_columns
from .base import Rule, register


@register
class TrimmedMean(Rule):
    name = "trimmed-mean"

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        n, f = X.shape[0], self.f
        return reduce_sorted_columns(
            X, lambda S: S[:, f : n - f].to(torch.float64).sum(dim=1) / (n - 2 * f)
        )
