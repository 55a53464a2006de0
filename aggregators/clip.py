"""Static norm clipping: every row scaled to norm at most ``c``.

``x_i <- x_i * min(1, c / ||x_i||)``. A pre-aggregator; it bounds any single row's influence
but by itself is not robust.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.geometry import row_norms
from robust.source import Rows, scaled
from .base import PreAggregator, register


def clip_rows(X: Rows, norms: torch.Tensor, c: float) -> Rows:
    """Each row of ``X`` scaled to norm ``<= c`` (``norms`` are its row norms)."""
    # a tensor divided by a tensor: ``c / norms`` with a Python ``c`` is computed as
    # ``c * (1 / norms)``, which is ``0 * inf = nan`` for a subnormal norm
    ratio = torch.as_tensor(c, dtype=norms.dtype, device=norms.device) / norms
    return scaled(X, torch.where(norms > c, ratio, 1.0))


@register
class Clip(PreAggregator):
    name = "clip"
    uses_f = False

    params = (Param("c", Interval(float, 0, None, "neither"), 1.0, "the largest norm a row may keep", tune=True),)

    def transformed(self, X: Rows) -> Rows:
        return clip_rows(X, row_norms(X), self.c)
