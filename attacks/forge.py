"""``forge:scale,consistent``: the honest update, scaled: a fabricated reply that looks honest.

Not from a paper: the case spot checks (``nodes.engine.spotcheck``) exist for. The node trains
honestly and sends::

    row <- scale * row          (default 0.9)

a plausible, slightly shorter step that no statistic can tell from an honest one; only
recomputing the task shows it was not the task's result.

Where nodes commit to their trajectory (``nodes.engine.trajectory``), a plain forger commits to
the trajectory it computed, whose last state does not give the row it sends. With
``consistent=true`` it lies consistently: it commits to its trajectory scaled toward the base,
each state ``s_i = [w, 0] + scale (h_i - [w, 0])`` (``h_i``: its honest states), and sends the row
its last claimed state gives. Every step of that trajectory is ``scale`` times an honest step,
so a dispute's per-step check (``nodes.engine.referee``) must catch a gap of ``1 - scale``.
Where nodes commit to no trajectory (the bench) it sends ``scale * row``; the row its scaled
trajectory gives, ``(w + scale * row) - w`` in float32, differs from that by at most an ulp of
``w`` in each coordinate.
"""

from __future__ import annotations

import torch

from robust.constraints import Flag, Interval, Param

from .base import Memory, NodeAttack, register


def scaled(states: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """The trajectory ``states`` shrunk toward its start by ``scale``."""
    return [states[0] + scale * (s - states[0]) for s in states]


@register
class Forge(NodeAttack):
    name = "forge"

    params = (Param("scale", Interval(float, 0, None, "neither"), 0.9, "the factor on the honest update"),
              Param("consistent", Flag(), False, "commit to the scaled trajectory (see above)"))

    def boost(self) -> float:
        return self.scale

    def commit(self, states: list[torch.Tensor], last: Memory | None) -> list[torch.Tensor] | None:
        return scaled(states, self.scale) if self.consistent else None
