"""Inner-product manipulation, IPM (Xie, Koyejo & Gupta, UAI 2019, "Fall of empires").

Every Byzantine row is ``-eps * mean(H)``: for small ``eps`` the aggregate keeps a negative
inner product with the true gradient once enough such rows pass the defence.
"""

from __future__ import annotations

import torch

from .base import Context, OmniscientAttack, register


def ipm_row(H: torch.Tensor, eps: float) -> torch.Tensor:
    return -eps * H.mean(dim=0)


@register
class IPM(OmniscientAttack):
    name = "ipm"

    def __init__(self, f: int, *, eps: float = 0.1) -> None:
        super().__init__(f)
        self._check_param("eps", eps, True, "a finite number")
        self.eps = eps

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        return ipm_row(H, self.eps)
