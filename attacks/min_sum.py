"""Min-Sum (Shejwalkar & Houmansadr, NDSS 2021, "Manipulating the Byzantine").

Min-Max's row and search (``min_max.py``): every Byzantine row is ``m = mean(H) - gamma * p``
with ``gamma`` the largest value that keeps ``m`` inside the honest cloud, here measured by
sums of squared distances::

    sum_i ||m - h_i||^2 <= max_i sum_j ||h_i - h_j||^2

Default ``dev=sign``, its strongest measured (min-max's docstring gives the figures).
"""

from __future__ import annotations

import torch

from .base import register
from .min_max import MinMaxSum


@register
class MinSum(MinMaxSum):
    name = "min-sum"

    def fits(self, radii_sq: torch.Tensor, honest_sq: torch.Tensor) -> bool:
        return bool(radii_sq.sum() <= honest_sq.sum(dim=1).max())
