"""Minimum-diameter averaging, MDA (El Mhamdi et al., ICML 2018; Rousseeuw 1985).

``F(X) = (1/(n-f)) sum_{i in S*} x_i`` with ``S*`` the subset of ``n - f`` rows of smallest
diameter ``max_{i,j in S} ||x_i - x_j||``; ties go to the subset whose excluded rows come
first in lexicographic order. Exact: all ``C(n, f)`` subsets are examined, vectorised in
batches, so the rule refuses inputs with more than 1,000,000 subsets
(``aggregators._subsets.MAX_SUBSETS``). Needs ``n > 2f``.
"""

from __future__ import annotations

import torch

from ._subsets import SubsetRule, alive
from .base import register


def subset_diameters(dist: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """Squared diameter of the rows left after removing each row of ``excluded`` (B, f)."""
    n = dist.shape[0]
    i, j = torch.triu_indices(n, n, offset=1, device=dist.device)
    pair_dist = dist[i, j]
    order = torch.sort(pair_dist, descending=True, stable=True).indices
    i, j, pair_dist = i[order], j[order], pair_dist[order]
    kept = alive(excluded, n)
    both = kept[:, i] & kept[:, j]  # (B, pairs): is the pair inside the subset?
    if both.shape[1] == 0:
        return torch.zeros(excluded.shape[0], dtype=dist.dtype, device=dist.device)
    first = both.to(torch.int8).argmax(dim=1)  # largest pair inside the subset
    return torch.where(both.any(dim=1), pair_dist[first], 0.0)


@register
class MDA(SubsetRule):
    name = "mda"
    instead = "multi-krum"

    def score(self, dist: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
        return subset_diameters(dist, excluded)
