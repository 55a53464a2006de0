"""``other-data``: a node that trains on data other than its own partition.

Not from a paper: the cheat of a volunteer that trains on what it has at hand (another node's
share, a cached copy) instead of the partition its task names. Here it trains on a seeded draw,
with replacement, from its own samples (a sample of the same distribution, so its update looks
as an honest one does)::

    (x, y) <- (x[j], y[j]),  j ~ Uniform{0..n-1}^n   (its poison stream)

Only a recomputation on the partition the task names shows it.
"""

from __future__ import annotations

import torch

from .base import NodeAttack, Sight, register


@register
class OtherData(NodeAttack):
    name = "other-data"

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator, sight: Sight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        j = torch.randint(len(y), (len(y),), generator=gen)
        return x[j], y[j]
