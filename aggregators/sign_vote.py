"""Majority vote of signs (Bernstein, Zhao, Azizzadenesheli and Anandkumar, ICLR 2019,
"signSGD with majority vote is communication efficient and fault tolerant").

Per coordinate, the sign most rows give, at the typical magnitude:
``F(X)_j = sign(sum_i sign(x_ij)) * median_i |x_ij|`` (a tie, or every row zero, gives 0).
signSGD's server steps by a fixed rate along the vote; here the step is the coordinate-wise
median of the magnitudes, so the rule returns a row on the honest rows' scale and works under
any protocol's server step. With ``n >= 2f + 1``, ``f`` Byzantine rows flip a coordinate only
where the honest vote's margin is at most ``2f``, and the magnitude stays between honest ones.
It suits the ``sign`` codec (each row one bit per coordinate and a scale per block), whose rows
it reads as votes. The vote is an integer count and the magnitude an order statistic, so the
result is bitwise the same for any order of the rows.
"""

from __future__ import annotations

import torch

from ._columns import median_of_sorted, reduce_sorted_columns
from .base import Rule, register


def _vote(S: torch.Tensor) -> torch.Tensor:
    """Sorted columns ``S`` -> each one's majority sign times its median magnitude (float64)."""
    votes = (S > 0).sum(dim=1) - (S < 0).sum(dim=1)
    magnitude = torch.sort(S.abs(), dim=1).values
    return torch.sign(votes).to(torch.float64) * median_of_sorted(magnitude)


@register
class SignVote(Rule):
    name = "sign-vote"
    uses_f = False

    def check_n(self, n: int) -> None:
        self._require(n >= 2 * self.f + 1, ">= 2f + 1", n)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        return reduce_sorted_columns(X, _vote)
