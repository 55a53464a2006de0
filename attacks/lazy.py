"""``lazy``: a free rider that replays its own previous update.

Free riders take the model without doing the work (Lin, Du & Liu, 2019, "Free-riders in
federated learning: attacks and defenses"; Fraboni, Vidal & Lorenzi, AISTATS 2021,
"Free-rider attacks on model aggregation in federated learning"). This one sends, in round
``t``, the update it computed honestly in its previous round (its first round is honest)::

    row_t <- row_{t-1}

Honest-looking, and caught only by recomputation (``nodes.engine.spotcheck``).
"""

from __future__ import annotations

import torch

from .base import NodeAttack, register


@register
class Lazy(NodeAttack):
    name = "lazy"
    remembers = True

    def forge(self, row: torch.Tensor, previous: torch.Tensor | None, own: torch.Tensor | None = None
              ) -> torch.Tensor:
        return row if previous is None else previous
