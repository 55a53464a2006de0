"""Coordinate-wise median (Yin et al., ICML 2018, "Byzantine-robust distributed learning").

``F(X)_j = median(x_1j, ..., x_nj)``; for even n the mean of the two middle values.
Needs ``n >= 2f + 1``. Bitwise the same for any order of the rows.
"""

from __future__ import annotations

import torch

from ._columns import median_of_sorted, reduce_sorted_columns
from .base import Rule, register


@register
class Median(Rule):
    name = "median"
    uses_f = False

    def check_n(self, n: int) -> None:
        self._require(n >= 2 * self.f + 1, ">= 2f + 1", n)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        return reduce_sorted_columns(X, median_of_sorted)
