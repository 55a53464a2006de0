"""FLAME (Nguyen et al., USENIX Security 2022, "FLAME: taming backdoors in federated learning").

1. HDBSCAN (scikit-learn) on the cosine distances ``1 - cos(x_i, x_j)`` (a zero row has cosine
   0 with every row), ``min_cluster_size = n//2 + 1``, ``min_samples = 1``: no two clusters fit,
   so the one it finds (``allow_single_cluster``, as in the reference codes) is the majority
   cluster ``K``. Its labelling keeps the rows still in the cluster at its densest level: rows
   at the edge of the honest cloud are dropped with the outliers (so do the reference codes,
   whose ``hdbscan`` package labels the same way). One row alone is kept;
2. ``S = median_i ||x_i||`` over all rows (the lower median when n is even);
3. ``F(X) = (1/|K|) sum_{i in K} x_i min(1, S / ||x_i||) + N(0, (noise S)^2 I_d)``.

Default ``noise = 0.001`` (the paper's lambda for image classification); ``noise = 0`` adds
none. The noise is drawn by a generator seeded with ``seed`` and the rows' content
(``aggregators._filtering``); the distances and norms are computed on the rows in content
order, so ``K`` is exactly order-invariant. Memory: the ``(n, n)`` distances. Needs ``n > 2f``
(the majority cluster is taken for the honest rows).
"""

from __future__ import annotations

import torch

from ._filtering import clipped_mean, draws, gram, in_input_order
from robust.constraints import Interval, Param

from .base import SEED, Rule, register


def majority_cluster(cosine: torch.Tensor) -> torch.Tensor:
    """Bool mask of the rows HDBSCAN puts in the cluster of more than half of them."""
    n = cosine.shape[0]
    if n == 1:  # HDBSCAN needs two rows
        return torch.ones(1, dtype=torch.bool, device=cosine.device)
    # scikit-learn is imported here: `import aggregators` stays fast for rules that never cluster
    from sklearn.cluster import HDBSCAN

    distances = (1.0 - cosine).clamp(0.0, 2.0)
    distances = 0.5 * (distances + distances.T)  # exactly symmetric whatever the BLAS did
    distances.fill_diagonal_(0.0)
    clusterer = HDBSCAN(min_cluster_size=n // 2 + 1, min_samples=1, metric="precomputed",
                        allow_single_cluster=True, copy=False)
    return torch.from_numpy(clusterer.fit(distances.cpu().numpy()).labels_ == 0).to(cosine.device)


@register
class Flame(Rule):
    name = "flame"
    uses_f = False

    params = (Param("noise", Interval(float, 0, None), 0.001, "the added noise's std, in median norms", tune=True), SEED)

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        order, gen = draws(X, self.name, self.seed)
        dots = gram(X, order, pairs=True)
        norms = dots.diagonal().sqrt()
        outer = norms[:, None] * norms[None, :]
        positive = outer > 0
        cosine = torch.where(positive, dots / torch.where(positive, outer, 1.0), 0.0).clamp(-1.0, 1.0)
        kept = majority_cluster(cosine)
        self.last_kept = in_input_order(kept, order)
        bound = norms.median()
        out = clipped_mean(X, order, kept, norms, bound)
        if self.noise > 0:
            sigma = self.noise * float(bound)
            # drawn on the CPU (the generator's device): the same noise whatever device the rows are on
            noise = torch.randn(X.shape[1], generator=gen, dtype=torch.float64, device="cpu") * sigma
            out += noise.to(device=X.device, dtype=X.dtype)
        return out
