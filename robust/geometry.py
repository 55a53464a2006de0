"""Pairwise geometry of the rows of ``X``, shared by aggregators and attacks.

Why not ``||a||^2 + ||b||^2 - 2 a.b`` in the input dtype: when rows share a large common
component (model updates usually do) the float32 Gram matrix cancels catastrophically and
Krum picks essentially at random. Here the rows are centred on a reference row and the Gram
matrix is accumulated block by block (``BLOCK`` columns at a time, so the extra memory is
O(n * BLOCK)) into float64:

- ``exact=True`` computes each block in float64: the distances match a float64 computation
  of the differences. Rules that make discrete choices (Krum, Multi-Krum, Bulyan, NNM, MDA)
  use it, because float32 rounding (~1e-6 relative) exceeds the gap between the best Krum
  scores once d is large.
- ``exact=False`` computes each block in the input dtype (2x faster for float32): relative
  error ~1e-6, enough for rules that solve a continuous problem (geometric median, CAF). If
  a float32 block overflows (rows above ~1e19) the exact path is taken.

The reference is the row of median norm: it lies inside the honest rows' range even when
``f < n/2`` rows are huge, so Byzantine values never swamp the honest rows' precision.
"""

from __future__ import annotations

import torch

BLOCK = 8192  # columns per block: 100 rows * 8192 * 8 B = 6.5 MB, cache-friendly


def row_norms(X: torch.Tensor, center: torch.Tensor | None = None) -> torch.Tensor:
    """``||x_i - center||`` for every row (float64, shape ``(n,)``), without a copy of ``X``."""
    if center is None:
        norms = torch.linalg.vector_norm(X, dim=1)
    else:  # direct differences, never the cancelling ||x||^2 - 2 x.c + ||c||^2
        c = center.to(X.dtype)[None]
        norms = torch.cdist(X, c, compute_mode="donot_use_mm_for_euclid_dist")[:, 0]
    norms = norms.to(torch.float64)
    for i in (~torch.isfinite(norms)).nonzero().flatten().tolist():  # overflow of finite rows
        row = X[i].to(torch.float64)
        norms[i] = torch.linalg.vector_norm(row if center is None else row - center.to(torch.float64))
    return norms


def sq_distances(X: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """Symmetric ``(n, n)`` float64 matrix of squared Euclidean distances between rows."""
    n, d = X.shape
    dtype = torch.float64 if exact else X.dtype
    ref = X[_median_index(row_norms(X))].to(dtype)
    gram = torch.zeros(n, n, dtype=torch.float64, device=X.device)
    buf = torch.empty(n, min(BLOCK, d), dtype=dtype, device=X.device)
    for s in range(0, d, BLOCK):
        block = buf[:, : min(BLOCK, d - s)]
        block.copy_(X[:, s : s + BLOCK])
        block -= ref[s : s + BLOCK]
        gram += block @ block.T
    if not exact and not bool(torch.isfinite(gram).all()):
        return sq_distances(X, exact=True)
    sq = gram.diagonal()
    dist = (sq[:, None] + sq[None, :] - 2.0 * gram).clamp_min_(0.0)
    dist = 0.5 * (dist + dist.T)  # exactly symmetric whatever the BLAS did
    dist.fill_diagonal_(0.0)
    return dist


def mix_rows(X: torch.Tensor, M: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = M @ X`` computed on column blocks, so ``out`` may be (a view of) ``X`` itself."""
    M = M.to(X.dtype)
    for s in range(0, X.shape[1], BLOCK):
        out[:, s : s + BLOCK] = M @ X[:, s : s + BLOCK]
    return out


def weighted_sum(X: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i x_i`` as a ``(d,)`` tensor in ``X``'s dtype (one pass over ``X``)."""
    return w.to(X.dtype) @ X


def _median_index(values: torch.Tensor) -> int:
    """Index of the lower median of ``values``; ties go to the lowest index."""
    order = torch.sort(values, stable=True).indices
    return int(order[(values.numel() - 1) // 2])
