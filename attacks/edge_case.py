"""``edge-case:source,target,stretch,fraction,radius,gamma,stop_after``: a backdoor on the tail
of the data (Wang, Sreenivasan, Rajput, Vishwakarma, Agarwal, Sohn, Lee & Papailiopoulos,
NeurIPS 2020, "Attack of the tails: yes, you really can backdoor federated learning").

The node teaches the model to misclassify inputs that are rare under the training distribution,
edge cases: honest nodes' data hardly covers them, so their updates rarely undo the damage, and
no trigger is needed. The paper takes its edge cases from another data set (ARDIS 7s, labelled
1, against MNIST). No data set can be fetched here, so the node makes them from its own samples
of class ``source``, each pushed away from the class mean into the class's tail::

    edge(x) = mu + stretch (x - mu)      (mu: the mean of the samples of class source at hand)

It trains on its data with a seeded ``fraction`` of the samples replaced by edge cases of its
``source`` samples (drawn with replacement), labelled ``target``; it then projects its update onto
the L2 ball of ``radius`` (the paper's PGD; 0: no projection) and scales it by ``gamma`` (model
replacement). A node holding no sample of ``source`` has nothing to poison and trains honestly.
With ``stop_after=R`` it is honest from round ``R + 1`` on. **Success** (:meth:`success`): the
share of the test set's samples of ``source``, made edge cases the same way (``mu`` from them),
that the model classifies as ``target``.

Defaults: source 7 and target 1 (the paper's MNIST task); ``fraction=0.8`` (FLPoison's share of
edge cases in the attacker's set); ``stretch=2`` (ours); no projection and no boost, since the
paper's radius (0.25) and boost are tuned to its own models.
"""

from __future__ import annotations

import math

import torch

from robust.constraints import Interval, Param

from .base import Memory, NodeAttack, Sight, register


@register
class EdgeCase(NodeAttack):
    name = "edge-case"

    params = (
        Param("source", Interval(int, 0, None), 7, "the class whose tail is misclassified"),
        Param("target", Interval(int, 0, None), 1, "the class the edge cases are taught to be"),
        Param("stretch", Interval(float, 1, None, "neither"), 2.0, "how far from the class mean an edge case lies, "
              "in multiples of the sample's own distance"),
        Param("fraction", Interval(float, 0, 1, "right"), 0.8, "the share of the node's samples replaced by edge cases"),
        Param("radius", Interval(float, 0, None), 0.0, "the L2 norm the update is projected within (0: none)"),
        Param("gamma", Interval(float, 0, None, "neither"), 1.0, "the update's boost"),
        Param("stop_after", Interval(int, 0, None), 0, "the last round the node attacks (0: it never stops)"),
    )

    def edge(self, x: torch.Tensor) -> torch.Tensor:
        """Edge cases of the samples ``x`` (all of class ``source``), about their own mean."""
        mu = x.float().mean(dim=0, keepdim=True)
        return (mu + self.stretch * (x.float() - mu)).to(x.dtype)

    def _check(self, classes: int) -> None:
        for key in ("source", "target"):
            if getattr(self, key) >= classes:
                raise ValueError(f"edge-case {key}={getattr(self, key)} but the data has {classes} classes")
        if self.source == self.target:
            raise ValueError(f"edge-case source and target are both {self.source}: choose two classes")

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator, sight: Sight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(classes)
        if not x.is_floating_point():
            raise ValueError("edge-case stretches feature values: it needs a data set of real-valued samples "
                             "(digits, mnist1d, images), not a text set's bytes")
        pool = (y == self.source).nonzero().flatten()
        if len(pool) == 0:
            return x, y
        count = math.ceil(self.fraction * x.shape[0])
        slots = torch.randperm(x.shape[0], generator=gen)[:count]
        drawn = torch.randint(len(pool), (count,), generator=gen)  # positions in the pool
        x, y = x.clone(), y.clone()
        x[slots] = self.edge(x[pool])[drawn]
        y[slots] = self.target
        return x, y

    def boost(self) -> float:
        return self.gamma

    def forge(self, row: torch.Tensor, previous: torch.Tensor | None, own: torch.Tensor | None = None
              ) -> torch.Tensor:
        if self.radius:
            norm = float(row.double().norm())
            if norm > self.radius:
                row = row * (self.radius / norm)
        return super().forge(row, previous, own)

    def success(self, model, w: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                last: Memory | None = None) -> float:
        """Share of the test set's ``source`` samples, made edge cases, classified as ``target``."""
        from robust.models import Scorer

        held = x_test[y_test == self.source]
        if len(held) == 0:
            raise ValueError(f"edge-case source={self.source}: the test set has no sample of that class")
        edges = self.edge(held)
        return Scorer(model)(w, edges, torch.full((edges.shape[0],), self.target))
