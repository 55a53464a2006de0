"""``constrain-scale:alpha,norm,target,fraction,size,value,gamma,stop_after``: a backdoor
trained to look like an honest update, then boosted up to the server's bound.

Bagdasaryan, Veit, Hua, Estrin and Shmatikov, AISTATS 2020, "How to backdoor federated
learning" (constrain-and-scale). The node poisons its data as ``backdoor`` does
(same trigger, target and parameters) and descends, at every local step, the loss

    L = alpha * L_class + (1 - alpha) * L_ano,     L_ano = ||w_local - w_global||^2

where ``L_class`` is the cross-entropy on its poisoned batch and ``L_ano`` the paper's
distance-based anomaly term: the squared L2 distance of the local parameters from the global
model the round started from, which keeps the update small and plausible to a detector that
measures distances. It then scales the row it sends up to the server's norm bound ``S``::

    row <- row * S / ||row||      (norm=S > 0, e.g. the coordinator's max-norm)
    row <- gamma * row            (norm=0: the ``backdoor`` boost, gamma=1 by default)

(a float32 hair below ``S`` where rounding would land above it: the coordinator, which
decides its bound in float64, would reject the row).

``alpha`` is the paper's trade-off between the backdoor and evasion; it leaves the value to
the attacker, and the default 0.7 is ours. ``alpha=1`` is plain backdoor training. Under the
``momentum`` protocol a node takes one gradient at ``w_global`` itself, where ``L_ano`` and
its gradient vanish: only ``alpha`` weighs the class loss. ``stop_after=R``: from round
``R + 1`` on the node is honest (no poisoning, no anomaly term, no scaling).
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param

from .base import Memory, Params, Shaping, register
from .backdoor import Backdoor


def distance2(local: Params, start: Params) -> torch.Tensor:
    """``||local - start||^2`` over every parameter tensor (the anomaly term ``L_ano``)."""
    return sum((local[k] - start[k]).square().sum() for k in local)


@register
class ConstrainScale(Backdoor):
    name = "constrain-scale"

    params = (  # and backdoor's
        Param("alpha", Interval(float, 0, 1, "right"), 0.7, "the weight of the class loss"),
        Param("norm", Interval(float, 0, None), 0.0, "the L2 norm to scale the update to (0: scale by gamma)"),
    )

    def shaping(self, round: int, w: torch.Tensor, last: Memory | None) -> Shaping | None:
        if not self.active(round) or self.alpha == 1:
            return None  # alpha=1 is the class loss alone: train exactly as backdoor does
        alpha = self.alpha
        return Shaping(loss=lambda ce, local, start: alpha * ce + (1 - alpha) * distance2(local, start))

    def forge(self, row: torch.Tensor, previous: torch.Tensor | None, own: torch.Tensor | None = None
              ) -> torch.Tensor:
        if not self.norm:
            return super().forge(row, previous, own)
        length = float(torch.linalg.vector_norm(row.to(torch.float64)))
        if length == 0.0:
            return row  # no direction to scale along
        factor = self.norm / length
        scaled = row * factor
        for _ in range(8):  # rounded above the bound: a few float32 ulps less (once is usually enough)
            if float(torch.linalg.vector_norm(scaled.to(torch.float64))) <= self.norm:
                break
            factor *= 1 - 2.0**-22
            scaled = row * factor
        return scaled
