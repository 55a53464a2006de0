"""Nearest-neighbour mixing, NNM (Allouah et al., AISTATS 2023, "Fixing by mixing").

``x_i <- 1/(n-f) sum_{j in N_i} x_j`` with ``N_i`` the ``n - f`` rows nearest to ``x_i``,
itself included; ties go to the lower row index. A pre-aggregator; needs ``n > 2f``.
The mixing is an ``(n, n)`` matrix applied to each column block as the next stage reads it,
so no ``(n, d)`` output is ever held, let alone the ``(n, n-f, d)`` gather of other
implementations.
"""

from __future__ import annotations

import torch

from robust.geometry import sq_distances
from robust.source import Rows, mixed
from .base import PreAggregator, register


@register
class NNM(PreAggregator):
    name = "nnm"
    keeps_rows = False

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)

    def transformed(self, X: Rows) -> Rows:
        n = X.shape[0]
        keep = n - self.f
        nearest = torch.sort(sq_distances(X), dim=1, stable=True).indices[:, :keep]
        mixing = torch.zeros(n, n, dtype=torch.float64, device=X.device)
        mixing.scatter_(1, nearest, 1.0 / keep)
        return mixed(X, mixing)
