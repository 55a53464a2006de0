"""Arithmetic mean: ``F(X) = (1/n) sum_i x_i``. Not robust: a single row can move it anywhere.

It is the baseline every robust rule is compared with (and FedAvg without sample weights).
"""

from __future__ import annotations

import torch

from robust.geometry import weighted_sum
from robust.source import Rows

from .base import Rule, register


@register
class Mean(Rule):
    name = "mean"
    uses_f = False

    def aggregate(self, X: Rows) -> torch.Tensor:
        return weighted_sum(X, torch.full((X.n,), 1.0 / X.n, dtype=torch.float64, device=X.device))
