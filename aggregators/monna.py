"""MoNNA, the average of one row's nearest neighbours (Farhadkhani et al., ICML 2023, "Robust
collaborative learning with linear gradient overhead").

``F(X) = (1/(n-f)) sum_{j in N_idx} x_j`` with ``N_idx`` the ``n - f`` rows nearest to
``x_idx``, itself included; ties go to the lower row index (as ``nnm``). ``idx`` is a position
in the rows' canonical order (the engine sorts a round's rows by node id): the row the
aggregate is centred on, which the paper's peer-to-peer setting takes to be the aggregating
node's own, honest, update. A coordinator has no row of its own among the volunteers', so it
trusts the node at ``idx`` to be honest; if that node is Byzantine, the aggregate is the mean
of a Byzantine row's neighbourhood. Needs ``n > 2f`` and ``idx < n``.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.geometry import sq_distances, weighted_sum
from .base import Rule, register


@register
class MoNNA(Rule):
    name = "monna"
    params = (
        Param("idx", Interval(int, 0, None), 0,
              "the position, in the rows' canonical order, of the row whose neighbourhood is averaged"),
    )

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)
        if self.idx >= n:
            raise ValueError(f"monna: idx={self.idx} names no row of the n={n} given: choose idx between 0 and {n - 1}")

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        n, keep = X.shape[0], X.shape[0] - self.f
        nearest = torch.sort(sq_distances(X)[self.idx], stable=True).indices[:keep]
        kept = torch.zeros(n, dtype=torch.bool, device=X.device)
        kept[nearest] = True
        self.last_kept = kept
        return weighted_sum(X, kept.to(torch.float64)) / keep
