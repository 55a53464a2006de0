"""Inner-product manipulation, IPM (Xie, Koyejo & Gupta, UAI 2019, "Fall of empires").

Every Byzantine row is ``-eps * mean(H)``: for small ``eps`` the aggregate keeps a negative
inner product with the true gradient once enough such rows pass the defence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from robust.constraints import Interval, Param

from .base import Context, OmniscientAttack, register


def ipm_rows(H: torch.Tensor) -> Callable[[float], torch.Tensor]:
    """``eps -> -eps mean(H)``, with the mean computed once."""
    mean = H.mean(dim=0)
    return lambda eps: -eps * mean


@register
class IPM(OmniscientAttack):
    name = "ipm"

    params = (Param("eps", Interval(float), 0.1, "the rows are -eps times the honest mean"),)

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        return ipm_rows(H)(self.eps)
