"""Mean around the median, MeaMed (Xie et al., 2018, "Generalized Byzantine-tolerant SGD").

Per coordinate, the mean of the ``n - f`` values closest to the coordinate's median:
``F(X)_j = 1/(n-f) sum_{i in N_j} x_ij`` with ``N_j`` the ``n - f`` indices minimising
``|x_ij - median_j|``; ties go to the smaller value, so the result does not depend on the
order of the rows (bitwise). Needs ``n > 2f``.
"""

from __future__ import annotations

import torch

from ._columns import mean_closest_to_median, reduce_sorted_columns
from .base import Rule, register


@register
class MeaMed(Rule):
    name = "meamed"

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        k = X.shape[0] - self.f
        return reduce_sorted_columns(X, lambda S: mean_closest_to_median(S, k))
