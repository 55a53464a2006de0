"""``alie-local``: A little is enough (Baruch, Baruch & Goldberg, NeurIPS 2019) played by a node
that sees no other node's update.

The paper's attackers estimate the honest nodes' per-coordinate mean and standard deviation
from updates they compute themselves on their own data; the omniscient ``alie`` is given the
honest rows instead. This node computes its honest row ``g_0`` and ``K = estimates`` more,
``g_1 .. g_K``, from the same model and momentum, each on its own draw of batches from its data
(``nodes.engine.training.estimates``), and sends::

    mean(g_0 .. g_K) - z * std(g_0 .. g_K)

(per coordinate, population standard deviation, summed row by row in that order). Its
spread is that of batch draws on one node's data, which is usually narrower than the spread
across nodes (they also differ in their data): the row stays inside the honest cloud, where
coordinate-wise and distance-based rules do not see it. ``z`` defaults to 1: the paper's ``z``
is a function of ``n`` and ``f``, which a node does not know. Costs ``K`` extra local
trainings a round.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.source import Rows, as_rows

from .base import NodeAttack, register


@register
class ALIELocal(NodeAttack):
    name = "alie-local"

    params = (
        Param("z", Interval(float), 1.0, "estimated honest stds below the estimated mean"),
        Param("estimates", Interval(int, 1, 64), 3, "the honest rows the node computes to estimate the spread"),
    )

    def forge(self, row: torch.Tensor, previous: torch.Tensor | None, own: torch.Tensor | Rows | None = None
              ) -> torch.Tensor:
        if own is None or tuple(own.shape) != (self.estimates, row.numel()):
            raise ValueError(f"alie-local forges from its {self.estimates} own honest rows (got "
                             f"{None if own is None else tuple(own.shape)}): compute them with "
                             "nodes.engine.training.estimates")
        # one (d,) row at a time, in a fixed order (a 100M-parameter node holds no (K + 1, d)
        # temporaries; a volunteer's rows are read from disk, each a fresh copy it may overwrite)
        rows = as_rows(own)
        mean = row.clone()
        for i in range(rows.n):
            mean += rows.row(i)
        mean /= rows.n + 1
        var = (row - mean).square_()
        for i in range(rows.n):
            var += rows.row(i).sub_(mean).square_()
        return var.div_(rows.n + 1).sqrt_().mul_(-self.z).add_(mean)
