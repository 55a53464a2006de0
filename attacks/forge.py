"""``forge:scale``: the honest update, scaled: a fabricated reply that looks honest.

Not from a paper: the case spot checks (``nodes.engine.spotcheck``) exist for. The node trains
honestly and sends::

    row <- scale * row          (default 0.9)

a plausible, slightly shorter step that no statistic can tell from an honest one; only
recomputing the task shows it was not the task's result.
"""

from __future__ import annotations

from .base import NodeAttack, register


@register
class Forge(NodeAttack):
    name = "forge"

    def __init__(self, f: int, *, scale: float = 0.9) -> None:
        super().__init__(f)
        self._check_param("scale", scale, scale > 0, "> 0: the factor on the honest update")
        self.factor = scale

    def scale(self) -> float:
        return self.factor
