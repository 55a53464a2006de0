"""``replay-row``: a node that signs the current task with what it computed for an earlier one.

A free rider (Lin, Du & Liu, 2019; Fraboni, Vidal & Lorenzi, AISTATS 2021), as ``lazy``, but
consistent: it sends its previous task's row *and* commits to that task's trajectory
(``nodes.engine.trajectory``), so a dispute finds states that match their commitment but start
from the model of an earlier round::

    row_t <- row_{t-1},   root_t <- root_{t-1}     (its first round is honest)

Where nodes commit to no trajectory (the bench) it is ``lazy``.
"""

from __future__ import annotations

import torch

from .base import Memory, register
from .lazy import Lazy


@register
class ReplayRow(Lazy):
    name = "replay-row"

    def commit(self, states: list[torch.Tensor], last: Memory | None) -> list[torch.Tensor] | None:
        return None if last is None or last.states is None else last.states
