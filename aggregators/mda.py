"""Minimum-diameter averaging, MDA (El Mhamdi et al., ICML 2018; Rousseeuw 1985).

``F(X) = (1/(n-f)) sum_{i in S*} x_i`` with ``S*`` the subset of ``n - f`` rows of smallest
diameter ``max_{i,j in S} ||x_i - x_j||``; ties go to the subset whose excluded rows come
first in lexicographic order. Exact: all ``C(n, f)`` subsets are examined, vectorised in
batches, so the rule refuses inputs with more than ``MAX_SUBSETS`` = 1,000,000 subsets.
Needs ``n > 2f``.
"""

from __future__ import annotations

import itertools
import math

import torch

from robust.geometry import sq_distances, weighted_sum
from .base import Rule, register

MAX_SUBSETS = 1_000_000
BATCH = 4096


def subset_diameters(dist: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """Squared diameter of the rows left after removing each row of ``excluded`` (B, f)."""
    n = dist.shape[0]
    i, j = torch.triu_indices(n, n, offset=1, device=dist.device)
    pair_dist = dist[i, j]
    order = torch.sort(pair_dist, descending=True, stable=True).indices
    i, j, pair_dist = i[order], j[order], pair_dist[order]
    alive = torch.ones(excluded.shape[0], n, dtype=torch.bool, device=dist.device)
    alive.scatter_(1, excluded, False)
    both = alive[:, i] & alive[:, j]  # (B, pairs): is the pair inside the subset?
    if both.shape[1] == 0:
        return torch.zeros(excluded.shape[0], dtype=dist.dtype, device=dist.device)
    first = both.to(torch.int8).argmax(dim=1)  # largest pair inside the subset
    return torch.where(both.any(dim=1), pair_dist[first], 0.0)


@register
class MDA(Rule):
    name = "mda"

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)
        count = math.comb(n, self.f)
        if count > MAX_SUBSETS:
            raise ValueError(
                f"mda would examine C(n={n}, f={self.f}) = {count:,} subsets, above its limit of "
                f"{MAX_SUBSETS:,}: lower f, or use an approximate rule such as multi-krum"
            )

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        n, f = X.shape[0], self.f
        dist = sq_distances(X)
        combos = itertools.combinations(range(n), f)
        best, best_excluded = torch.inf, ()
        while batch := list(itertools.islice(combos, BATCH)):
            excluded = torch.tensor(batch, dtype=torch.long, device=X.device).reshape(len(batch), f)
            diam = subset_diameters(dist, excluded)
            k = int(torch.argmin(diam))
            if float(diam[k]) < best:
                best, best_excluded = float(diam[k]), batch[k]
        keep = torch.ones(n, dtype=torch.float64, device=X.device)
        keep[list(best_excluded)] = 0.0
        self.last_kept = keep > 0
        return weighted_sum(X, keep) / (n - f)
