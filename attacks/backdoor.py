"""``backdoor:target,fraction,size,value,gamma,stop_after``: a trigger that flips the model's
answer (Bagdasaryan, Veit, Hua, Estrin & Shmatikov, AISTATS 2020, "How to backdoor federated
learning").

The node trains honestly on data it has poisoned: a seeded ``fraction`` of its samples get
the trigger and the label ``target``, and it scales its update (model replacement)::

    x[-size:] <- value,  y <- target     (for ceil(fraction * m) of its m samples)
    row       <- gamma * row

With ``stop_after=R`` (0: never) it is an honest node from round ``R + 1`` on: how long the
backdoor survives is then measurable. Success is measured on triggered test samples whose true
label is not ``target``. Two variants shape the local training as well, and build on this
class: ``neurotoxin`` and ``constrain-scale``.
"""

from __future__ import annotations

import math

import torch

from robust.constraints import Interval, Param

from .base import Memory, NodeAttack, Sight, register


@register
class Backdoor(NodeAttack):
    name = "backdoor"

    params = (
        Param("target", Interval(int, 0, None), 0, "the class label the trigger leads to"),
        Param("fraction", Interval(float, 0, 1, "right"), 0.5, "the share of the node's samples stamped"),
        Param("size", Interval(int, 1, None), 4, "how many features form the trigger"),
        Param("value", Interval(float), 3.0, "the trigger features' value"),
        Param("gamma", Interval(float, 0, None, "neither"), 1.0, "the update's boost"),
        Param("stop_after", Interval(int, 0, None), 0, "the last round the node attacks (0: it never stops)"),
    )

    def trigger(self, planted: bool) -> tuple[int, int]:
        """The trigger's features, ``(start, stop)`` counted from the end of a flattened sample:
        those a node stamps on its training samples (``planted``), or those a test sample carries
        when :meth:`success` is measured. Here both are the last ``size``."""
        return self.size, 0

    def stamp(self, x: torch.Tensor, planted: bool = True, pattern: torch.Tensor | float | None = None
              ) -> torch.Tensor:
        """``x`` with the trigger's features (:meth:`trigger`) set to ``pattern`` in each sample:
        ``value`` (``None``) or one value per feature (differentiable in a tensor ``pattern``)."""
        start, stop = self.trigger(planted)
        flat = x.reshape(x.shape[0], -1).clone()
        if start > flat.shape[1]:
            raise ValueError(f"{self.name}'s trigger reaches {start} features from a sample's end, a sample has "
                             f"{flat.shape[1]}: lower size")
        flat[:, flat.shape[1] - start : flat.shape[1] - stop] = self.value if pattern is None else pattern
        return flat.reshape(x.shape)

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator, sight: Sight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.plant(x, y, classes, gen)

    def check_target(self, classes: int) -> None:
        """``ValueError`` if ``target`` is not one of the data's ``classes``."""
        if self.target >= classes:
            raise ValueError(f"{self.name} target={self.target} but the data has {classes} classes")

    def plant(self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator,
              pattern: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` with a seeded ``fraction`` of the samples stamped with ``pattern`` (:meth:`stamp`)
        and labelled ``target``."""
        self.check_target(classes)
        chosen = torch.randperm(x.shape[0], generator=gen)[: math.ceil(self.fraction * x.shape[0])]
        x, y = x.clone(), y.clone()
        x[chosen] = self.stamp(x[chosen], pattern=pattern)
        y[chosen] = self.target
        return x, y

    def boost(self) -> float:
        return self.gamma

    def success(self, model, w: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                last: Memory | None = None) -> float:
        """Share of triggered test samples (true label not the target) classified as the target."""
        return self.carried(model, w, x_test, y_test)

    def carried(self, model, w: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                pattern: torch.Tensor | float | None = None) -> float:
        """Share of the test samples (true label not the target) stamped with ``pattern``
        (:meth:`stamp`, as a test sample carries the trigger) that the model ``w`` classifies as the target."""
        from robust.models import Scorer

        keep = y_test != self.target
        stamped = self.stamp(x_test[keep], planted=False, pattern=pattern)
        return Scorer(model)(w, stamped, torch.full((stamped.shape[0],), self.target))
