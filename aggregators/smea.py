"""Smallest maximum eigenvalue averaging, SMEA (Allouah et al., ICML 2023, "On the
privacy-robustness-utility trilemma in distributed learning").

``F(X) = (1/(n-f)) sum_{i in S*} x_i`` with ``S*`` the subset of ``n - f`` rows whose empirical
covariance has the smallest largest eigenvalue:
``S* = argmin_{|S| = n-f} lambda_max( (1/|S|) sum_{i in S} (x_i - xbar_S)(x_i - xbar_S)^T )``.

Exact, and with no ``(d, d)`` matrix: the covariance's nonzero eigenvalues are those of the
subset's centred Gram matrix ``-1/2 J D_S J`` over ``|S|`` (``D_S`` the subset's squared
distances, ``J = I - 11^T/|S|``), an ``(n-f, n-f)`` symmetric matrix, so one pass over the rows
gives the exact distances (``robust.geometry``, shared with the round's detectors) and each
subset costs one small symmetric eigenproblem, batched. ByzFL's ``SMEA`` estimates each
subset's eigenvalue with one power-iteration step from a random vector instead, so its choice
can change from one call to the next.

Cost: all ``C(n, f)`` subsets are examined; the rule refuses inputs with more than 1,000,000
(``aggregators._subsets.MAX_SUBSETS``), as ``mda`` does. Measured on 2 cores (float64
eigenvalues, batches of 4096), after the distances: n = 20, f = 4 (4,845 subsets) 0.19 s,
n = 25, f = 5 (53,130) 1.1 s, n = 27, f = 7 (888,030 subsets of 20 rows) 16.5 s.
Ties, and subsets whose eigenvalues differ by less than a relative 1e-9 (what two LAPACK builds
may differ by), go to the subset whose excluded rows come first in lexicographic order. Needs
``n > 2f``.
"""

from __future__ import annotations

import torch

from ._subsets import SubsetRule, kept_rows
from .base import register

RTOL = 1e-9  # eigenvalues this close (relative) are a tie


def largest_eigenvalues(dist: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """The largest eigenvalue of the empirical covariance of the rows left after removing each
    row of ``excluded`` ``(B, f)``, from the rows' squared distances ``dist`` (float64 ``(n, n)``)."""
    keep = kept_rows(excluded, dist.shape[0])
    m = keep.shape[1]
    sub = dist[keep[:, :, None], keep[:, None, :]]  # (B, m, m)
    means = sub.mean(dim=2)
    centred = (sub - means[:, :, None] - means[:, None, :] + means.mean(dim=1)[:, None, None]).mul_(-0.5)
    return torch.linalg.eigvalsh(centred)[:, -1] / m


@register
class SMEA(SubsetRule):
    name = "smea"
    instead = "nnm+trimmed-mean"
    rtol = RTOL

    def score(self, dist: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
        return largest_eigenvalues(dist, excluded)
