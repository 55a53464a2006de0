"""``inf``: rows of ``+inf``, what a crashed or hostile node may send.

Not from a paper: a check of the coordinator's own defences. Every Byzantine row is
``(+inf, ..., +inf)``; validation must reject such rows before any rule sees them (a mean
of them is ``inf``), and the run goes on with the rows left.
"""

from __future__ import annotations

import torch

from .base import Context, OmniscientAttack, register


@register
class Inf(OmniscientAttack):
    name = "inf"

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        return torch.full_like(H[0], torch.inf)
