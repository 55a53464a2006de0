"""Arithmetic mean: ``F(X) = (1/n) sum_i x_i``. Not robust: a single row can move it anywhere.

It is the baseline every robust rule is compared with (and FedAvg without sample weights).
"""

from __future__ import annotations

import torch

from .base import Rule, register


@register
class Mean(Rule):
    name = "mean"

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        return X.mean(dim=0)
