"""Loss-score aggregation: the mean of the rows of the best-rated nodes, rated by what their
updates did to the loss of the coordinator's held-out data (as Templar's Gauntlet aggregates
its top-rated peers, Covenant-72B).

``F(X) = (1/m) sum_{i in M} x_i`` with ``M`` the ``m`` rows whose nodes have the highest
rating (ties to the lower row index); default ``m = n - f``. A node's rating is its OpenSkill
Plackett-Luce ordinal ``mu - 3 sigma`` over the rounds so far, this round's included: each
round the engine steps the model by each row alone, at its share of the mean, measures the loss on its root samples, and
ranks the nodes by it (``nodes.engine.loss_ratings``). So the rule needs the coordinator's root
set (``root = N``) and gets the ratings through ``RoundInputs(ratings=...)``. Needs
``n > 2f`` and ``1 <= m <= n``.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.geometry import weighted_sum
from .base import RoundInputs, Rule, register


@register
class LossScore(Rule):
    name = "loss-score"
    needs = frozenset({"ratings"})

    params = (Param("m", Interval(int, 1, None), None, "how many rows to average (default n - f)"),)

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)
        if self.m is not None and self.m > n:
            raise ValueError(f"loss-score m={self.m} exceeds the n={n} rows: lower m")

    def aggregate(self, X: torch.Tensor, inputs: RoundInputs) -> torch.Tensor:
        n = X.shape[0]
        m = self.m if self.m is not None else n - self.f
        best = torch.sort(-inputs.ratings.to(torch.float64), stable=True).indices[:m]
        kept = torch.zeros(n, dtype=torch.bool, device=X.device)
        kept[best] = True
        self.last_kept = kept
        return weighted_sum(X, kept.to(torch.float64)) / m
