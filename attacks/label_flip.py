"""``label-flip``: the node trains honestly on flipped labels.

The label-flipping data poisoning of Fang, Cao, Jia & Gong (USENIX Security 2020, "Local
model poisoning attacks to Byzantine-robust federated learning"), also a baseline of
Karimireddy, He & Jaggi (ICLR 2022): with ``C`` classes, every label of the node's data is::

    y -> C - 1 - y

and its update is then computed exactly as an honest node's.
"""

from __future__ import annotations

import torch

from .base import NodeAttack, Sight, register


@register
class LabelFlip(NodeAttack):
    name = "label-flip"

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator, sight: Sight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x, classes - 1 - y
