"""``fewer-steps:fraction``: a node that does part of the work it was asked for.

Not from a paper: a free rider that saves compute (Lin, Du & Liu, 2019, "Free-riders in
federated learning"), the cheat that recomputation exists for. Asked for ``K`` local steps, it
takes the first ``floor(fraction * K)`` and stands still for the rest::

    local_i <- local_{i-1} - lr v_i   for i <= floor(fraction * K),   local_i <- local_{i-1} after

A shorter, honest-looking step that no statistic can tell from a slow learner's; a spot check's
recomputation, or a dispute's recomputation of the first step it skipped, shows it.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param

from .base import Memory, NodeAttack, Shaping, register


@register
class FewerSteps(NodeAttack):
    name = "fewer-steps"

    params = (Param("fraction", Interval(float, 0, 1, "right"), 0.5, "the share of the local steps taken"),)

    def shaping(self, round: int, w: torch.Tensor, last: Memory | None) -> Shaping | None:
        return Shaping(fraction=self.fraction)
