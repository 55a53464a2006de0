"""``forge:scale``: the honest update, scaled: a fabricated reply that looks honest.

Not from a paper: the case spot checks (``nodes.engine.spotcheck``) exist for. The node trains
honestly and sends::

    row <- scale * row          (default 0.9)

a plausible, slightly shorter step that no statistic can tell from an honest one; only
recomputing the task shows it was not the task's result.
"""

from __future__ import annotations

from robust.constraints import Interval, Param

from .base import NodeAttack, register


@register
class Forge(NodeAttack):
    name = "forge"

    params = (Param("scale", Interval(float, 0, None, "neither"), 0.9, "the factor on the honest update"),)

    def boost(self) -> float:
        return self.scale
