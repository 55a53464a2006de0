"""Node-side attacks: the Byzantine node trains honestly on data it has poisoned.

- ``label-flip``: every label ``y -> C - 1 - y``.
- ``backdoor:target,fraction,size,value,gamma,stop_after`` (Bagdasaryan et al., AISTATS 2020,
  "How to backdoor federated learning"): a seeded ``fraction`` of the node's samples get a
  trigger (their last ``size`` features set to ``value``) and the label ``target``; the node
  scales its update by ``gamma`` (model replacement). With ``stop_after=R`` (0: never) it is
  an honest node from round ``R + 1`` on: how long the backdoor survives is then measurable.
  Success is measured on triggered test samples whose true label is not ``target``. Two
  variants shape the local training as well: ``neurotoxin`` and ``constrain-scale``.
- ``forge:scale=0.9``: trains honestly and sends its update times ``scale``: a plausible,
  slightly shorter step that no statistic can tell from an honest one; only recomputing the
  task (``nodes.spotcheck``) shows it was not the task's result.
- ``lazy``: sends the update it computed in its previous round as this round's (a free rider
  replaying its own honest work; its first round is honest). Honest-looking, and caught
  only by recomputation.
"""

from __future__ import annotations

import math

import torch

from .base import NodeAttack, register


@register
class LabelFlip(NodeAttack):
    name = "label-flip"

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x, classes - 1 - y


@register
class Backdoor(NodeAttack):
    name = "backdoor"

    def __init__(
        self, f: int, *, target: int = 0, fraction: float = 0.5, size: int = 4,
        value: float = 3.0, gamma: float = 1.0, stop_after: int = 0,
    ) -> None:
        super().__init__(f)
        self._check_param("target", target, target >= 0, ">= 0: a class label")
        self._check_param("fraction", fraction, 0 < fraction <= 1, "in (0, 1]")
        self._check_param("size", size, size >= 1, ">= 1: how many features form the trigger")
        self._check_param("value", value, True, "a finite number")
        self._check_param("gamma", gamma, gamma > 0, "> 0: the update's boost")
        self._check_param("stop_after", stop_after, stop_after >= 0,
                          ">= 0: the last round the node attacks (0: it never stops)")
        self.target, self.fraction, self.size = target, fraction, size
        self.value, self.gamma, self.stop_after = value, gamma, stop_after

    def stamp(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the trigger: the last ``size`` features of each sample set to ``value``."""
        flat = x.reshape(x.shape[0], -1).clone()
        flat[:, -self.size :] = self.value
        return flat.reshape(x.shape)

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.target >= classes:
            raise ValueError(f"backdoor target={self.target} but the data has {classes} classes")
        chosen = torch.randperm(x.shape[0], generator=gen)[: math.ceil(self.fraction * x.shape[0])]
        x, y = x.clone(), y.clone()
        x[chosen] = self.stamp(x[chosen])
        y[chosen] = self.target
        return x, y

    def scale(self) -> float:
        return self.gamma


@register
class Forge(NodeAttack):
    name = "forge"

    def __init__(self, f: int, *, scale: float = 0.9) -> None:
        super().__init__(f)
        self._check_param("scale", scale, scale > 0, "> 0: the factor on the honest update")
        self.factor = scale

    def scale(self) -> float:
        return self.factor


@register
class Lazy(NodeAttack):
    name = "lazy"
    remembers = True

    def forge(self, row: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        return row if previous is None else previous
