"""``sign-flip``: the honest updates' mean, reversed.

The bit-flipping baseline of Karimireddy, He & Jaggi (ICLR 2022, "Byzantine-robust learning
on heterogeneous datasets via bucketing"), where each Byzantine node sends its own gradient
negated; an omniscient coalition sends the honest mean negated instead::

    every Byzantine row = -mean(H)
"""

from __future__ import annotations

import torch

from .base import Context, OmniscientAttack, register


@register
class SignFlip(OmniscientAttack):
    name = "sign-flip"

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        return -H.mean(dim=0)
