"""Adaptive robust clipping, ARC (Allouah et al., NeurIPS 2024, "Boosting robustness by
clipping gradients in distributed learning").

With ``k = floor(2 (f/n) (n - f))``, the ``k`` rows of largest norm are clipped to the
``(k+1)``-th largest norm; the other rows are unchanged. Ties in norm go to the lower row
index. Needs ``n > 2f``.
"""

from __future__ import annotations

import torch

from robust.geometry import row_norms
from robust.source import Rows
from .base import PreAggregator, register
from .clip import clip_rows


@register
class ARC(PreAggregator):
    name = "arc"

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)

    def transformed(self, X: Rows) -> Rows:
        n = X.shape[0]
        k = (2 * self.f * (n - self.f)) // n
        if k == 0:
            return X
        norms = row_norms(X)
        threshold = float(torch.sort(norms, descending=True, stable=True).values[k])
        return clip_rows(X, norms, threshold)
