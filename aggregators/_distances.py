"""Exact pairwise geometry of the rows of ``X``, shared by the distance-based rules.

Why not ``||a||^2 + ||b||^2 - 2 a.b`` in the input dtype: when rows share a large common
component (model updates usually do) the float32 Gram matrix cancels catastrophically and
Krum picks essentially at random. Here the rows are centred on a reference row and the
Gram matrix is accumulated in float64, chunk by chunk, so the extra memory is O(n * chunk)
and the result matches a float64 computation of the differences.

The reference is the row of median norm: it lies inside the honest rows' range even when
``f < n/2`` rows are huge, so Byzantine values never swamp the honest rows' precision.
"""

from __future__ import annotations

import torch

CHUNK = 8192  # columns per float64 block: 100 rows * 8192 * 8 B = 6.5 MB, cache-friendly


def column_blocks(d: int, size: int = CHUNK) -> range:
    """Start indices of the column blocks of a width-``d`` matrix."""
    return range(0, d, size)


def row_sq_norms(X: torch.Tensor, center: torch.Tensor | None = None) -> torch.Tensor:
    """``||x_i - center||^2`` for every row, accumulated in float64 (shape ``(n,)``)."""
    n, d = X.shape
    acc = torch.zeros(n, dtype=torch.float64, device=X.device)
    for s in column_blocks(d):
        block = X[:, s : s + CHUNK].to(torch.float64)
        if center is not None:
            block = block - center[s : s + CHUNK].to(torch.float64)
        acc += block.square().sum(dim=1)
    return acc


def sq_distances(X: torch.Tensor) -> torch.Tensor:
    """Symmetric ``(n, n)`` float64 matrix of squared Euclidean distances between rows."""
    n, d = X.shape
    norms = row_sq_norms(X)
    ref = X[_median_index(norms)].to(torch.float64)
    gram = torch.zeros(n, n, dtype=torch.float64, device=X.device)
    buf = torch.empty(n, min(CHUNK, d), dtype=torch.float64, device=X.device)
    for s in column_blocks(d):
        block = buf[:, : min(CHUNK, d - s)]
        block.copy_(X[:, s : s + CHUNK])
        block -= ref[s : s + CHUNK]
        gram.addmm_(block, block.T)
    sq = gram.diagonal()
    dist = (sq[:, None] + sq[None, :] - 2.0 * gram).clamp_min_(0.0)
    dist = 0.5 * (dist + dist.T)  # exactly symmetric whatever the BLAS did
    dist.fill_diagonal_(0.0)
    return dist


def weighted_sum(X: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i x_i`` as a ``(d,)`` tensor in ``X``'s dtype (one pass over ``X``)."""
    return w.to(X.dtype) @ X


def _median_index(values: torch.Tensor) -> int:
    """Index of the lower median of ``values``; ties go to the lowest index."""
    order = torch.sort(values, stable=True).indices
    return int(order[(values.numel() - 1) // 2])
