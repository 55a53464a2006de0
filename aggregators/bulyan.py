"""Bulyan (El Mhamdi et al., ICML 2018, "The hidden vulnerability of distributed learning
in Byzantium").

1. Selection: ``theta = n - 2f`` rows, each chosen by Krum (with the same f) on the rows not
   yet chosen, then removed from the candidates (ties to the lowest row index).
2. Aggregation: per coordinate j, the mean of the ``beta = theta - 2f`` selected values
   closest to their median: ``F(X)_j = 1/beta sum_{i in B_j} x_ij``.

Needs ``n >= 4f + 3``. (Flower's message-API ``Bulyan`` differs: it averages the beta values
closest to the median of *all* selected rows' values using a different selection.)
"""

from __future__ import annotations

import torch

from ._columns import mean_closest_to_median, reduce_sorted_columns
from robust.geometry import sq_distances
from .base import Rule, register
from .krum import krum_scores


def bulyan_selection(dist: torch.Tensor, f: int, theta: int) -> torch.Tensor:
    """Row indices picked by ``theta`` rounds of Krum on the shrinking candidate set."""
    remaining = torch.arange(dist.shape[0], device=dist.device)
    picked = []
    for _ in range(theta):  # theta Krum rounds on an (r, r) matrix: O(n^3 log n), no d
        sub = dist[remaining][:, remaining]
        best = int(torch.argmin(krum_scores(sub, f)))
        picked.append(int(remaining[best]))
        remaining = torch.cat([remaining[:best], remaining[best + 1 :]])
    return torch.tensor(sorted(picked), device=dist.device)


@register
class Bulyan(Rule):
    name = "bulyan"

    def check_n(self, n: int) -> None:
        self._require(n >= 4 * self.f + 3, ">= 4f + 3", n)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        n, f = X.shape[0], self.f
        theta = n - 2 * f
        selected = bulyan_selection(sq_distances(X), f, theta)
        self.last_kept = torch.zeros(n, dtype=torch.bool, device=X.device)
        self.last_kept[selected] = True
        beta = theta - 2 * f
        return reduce_sorted_columns(X, lambda S: mean_closest_to_median(S, beta), selected)
