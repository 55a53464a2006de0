"""``bad-dispute:scale``: a forger that answers its dispute with states it never committed to.

Not from a paper: the cheat a commitment exists for. The node forges consistently, as
``forge:consistent=true`` does (it commits to its honest trajectory scaled by ``scale`` toward
the base and sends the row that trajectory gives), and when a dispute asks for its states it
answers with its honest ones, which would pass every step's recomputation but do not hash to
what it signed. Where nodes commit to no trajectory (the bench) it sends ``scale * row``, as
``forge`` does.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param

from .base import Memory, NodeAttack, register
from .forge import scaled


@register
class BadDispute(NodeAttack):
    name = "bad-dispute"

    params = (Param("scale", Interval(float, 0, None, "neither"), 0.999, "the factor on the honest trajectory"),)

    def boost(self) -> float:
        return self.scale

    def commit(self, states: list[torch.Tensor], last: Memory | None) -> list[torch.Tensor] | None:
        return scaled(states, self.scale)

    def answer(self, committed: list[torch.Tensor], computed: list[torch.Tensor]) -> list[torch.Tensor]:
        return computed
