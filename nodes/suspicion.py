"""Which accepted rows of a round look Byzantine: the coordinator's flag, per node and round.

A row is flagged when its distance to the coordinate-wise median is more than ``ratio``
times the median of those distances (robust to up to half the rows lying), or when the
aggregation rule selects rows and discarded it. Flags accumulate per node (with rejected
replies) and lead to quarantine; they never change the round's aggregate.
"""

from __future__ import annotations

import torch

import aggregators
from robust.geometry import row_norms


def flagged(X: torch.Tensor, kept: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """Bool ``(n,)``: which rows of ``X`` (canonical order) are suspicious."""
    median = aggregators.build("median", 0)(X)
    distance = row_norms(X, median)
    out = distance > ratio * distance.median()
    if kept is not None:
        out |= ~kept.to(torch.bool)
    return out
