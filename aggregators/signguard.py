"""SignGuard (Xu et al., ICDCS 2022, "SignGuard: Byzantine-robust federated learning through
collaborative malicious gradient filtering").

With ``M`` the median row norm (the lower median when n is even, so always some row's norm):

1. norm filter: ``S1 = {i : lower M <= ||x_i|| <= upper M}``;
2. sign statistics: on ``k = max(1, round(frac d))`` coordinates drawn at random, each row's fractions
   of positive, zero and negative values ``(p_i, z_i, q_i)``, clustered by MeanShift (the
   paper's choice; flat kernel, every row a seed, every row labelled, as scikit-learn's
   ``MeanShift``, vectorised here); ``S2`` is the largest cluster (ties to the denser one).
   The bandwidth is scikit-learn's estimate (the mean distance of a row to its
   ``max(1, floor(n/2))``-th nearest row, itself counted) but at least ``1/k``: an estimate of
   0 means most rows share their statistics exactly, and ``1/k`` is below the ``sqrt(2)/k``
   between any two different statistics, so those rows then form ``S2``;
3. ``F(X) = (1/|S|) sum_{i in S} x_i min(1, M / ||x_i||)`` with ``S = S1 & S2``, or ``S1``
   when that intersection is empty (the largest cluster is then a minority of rows, all
   rejected by the norm filter; ``S1`` holds the median row, so it is never empty).

Defaults ``lower = 0.1``, ``upper = 3``, ``frac = 0.1`` (the paper's and the reference codes').
The coordinates are drawn by a generator seeded with ``seed`` and the rows' content
(``aggregators._filtering``); the norms and statistics are computed on the rows in content
order, so ``S`` is exactly order-invariant. Needs ``n > 2f`` (the largest cluster is taken
for the honest one).
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.source import Rows, column_blocks

from ._filtering import F64, clipped_mean, draws, gram, in_input_order
from .base import SEED, Rule, register


def sign_statistics(X: Rows, columns: torch.Tensor) -> torch.Tensor:
    """Each row's fractions of positive, zero and negative values among the sorted
    ``columns``, ``(n, 3)`` float64, counted block by block (extra memory O(n * BLOCK))."""
    counts = torch.zeros(X.n, 3, dtype=torch.long, device=X.device)
    for _, sub in column_blocks(X, columns):
        counts += torch.stack([(sub > 0).sum(dim=1), (sub == 0).sum(dim=1), (sub < 0).sum(dim=1)], dim=1)
    return counts.to(F64) / columns.numel()


def distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Euclidean distances between the rows of ``a`` and of ``b``, computed directly (equal rows: 0)."""
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def bandwidth(features: torch.Tensor, floor: float) -> float:
    """scikit-learn's ``estimate_bandwidth(quantile=0.5)``: the mean distance of a row to its
    ``max(1, floor(n/2))``-th nearest row (itself counted), but at least ``floor``."""
    m = max(1, features.shape[0] // 2)
    nearest = distances(features, features).sort(dim=1).values[:, m - 1]
    return max(float(nearest.mean()), floor)


def largest_cluster(features: torch.Tensor, h: float, max_iter: int = 300) -> torch.Tensor:
    """Bool mask of the largest cluster of scikit-learn's ``MeanShift(bandwidth=h)`` on the rows
    of ``features`` (every row a seed, every row labelled), vectorised over the seeds:
    scikit-learn's takes ~0.1 s per call even on a dozen rows.

    Each seed moves to the mean of the rows within ``h`` of it until it moves at most
    ``h/1000``; its density is the number of rows in its last ball. The modes, by decreasing
    density then decreasing coordinates, absorb the later modes within ``h`` of them; a row
    belongs to its nearest mode; ties go to the earlier mode.
    """
    modes = features.clone()
    density = torch.zeros(features.shape[0], dtype=torch.long, device=features.device)
    moving = torch.ones(features.shape[0], dtype=torch.bool, device=features.device)
    for _ in range(max_iter + 1):
        # never an empty ball: the mean of rows within h of a point has one of them within h
        near = distances(modes, features) <= h
        count = near.sum(dim=1)
        shifted = (near.to(features.dtype) @ features) / count[:, None]
        step = torch.linalg.vector_norm(shifted - modes, dim=1)
        modes = torch.where(moving[:, None], shifted, modes)
        density = torch.where(moving, count, density)
        moving &= step > 1e-3 * h
        if not moving.any():
            break
    rank = torch.arange(modes.shape[0], device=modes.device)
    for key in [*modes.T.flip(0), density]:  # least significant key first, each sort stable
        rank = rank[torch.sort(key[rank], descending=True, stable=True).indices]
    modes = modes[rank]
    kept = torch.ones(modes.shape[0], dtype=torch.bool, device=features.device)
    for i in range(modes.shape[0]):  # one pass over the n modes, densest first
        if kept[i]:
            kept[i + 1 :] &= torch.linalg.vector_norm(modes[i + 1 :] - modes[i], dim=1) > h
    labels = distances(features, modes[kept]).argmin(dim=1)
    return labels == int(torch.bincount(labels).argmax())


@register
class SignGuard(Rule):
    name = "signguard"
    uses_f = False

    params = (  # lower <= 1 <= upper: the median row passes the norm filter
        Param("lower", Interval(float, 0, 1), 0.1, "the norm filter's low end, in median norms", tune=True),
        Param("upper", Interval(float, 1, None), 3.0, "the norm filter's high end, in median norms", tune=True),
        Param("frac", Interval(float, 0, 1, "right"), 0.1, "the fraction of coordinates whose signs are counted", tune=True),
        SEED,
    )

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)

    def aggregate(self, X: Rows) -> torch.Tensor:
        d = X.shape[1]
        order, gen = draws(X, self.name, self.seed)
        norms = gram(X, order, pairs=False).sqrt()
        median = norms.median()
        by_norm = (norms >= self.lower * median) & (norms <= self.upper * median)
        k = max(1, round(self.frac * d))
        # drawn on the CPU (the generator's device): the same columns whatever device the rows are on
        columns = torch.randperm(d, generator=gen, device="cpu")[:k].sort().values.to(X.device)
        stats = sign_statistics(X, columns)[order]  # exact counts: the same in any row order
        by_sign = largest_cluster(stats, bandwidth(stats, 1.0 / k))
        kept = by_norm & by_sign
        if not kept.any():
            kept = by_norm
        self.last_kept = in_input_order(kept, order)
        return clipped_mean(X, order, kept, norms, median)
