"""Divide-and-Conquer, DnC (Shejwalkar & Houmansadr, NDSS 2021, "Manipulating the Byzantine:
optimizing model poisoning attacks and defenses for federated learning").

``iters`` times: draw ``b`` of the ``d`` coordinates at random (all of them when ``b >= d``),
centre the sub-matrix ``Y`` (rows ``y_i``, column mean ``mu``), take its top right-singular
vector ``v``, score ``s_i = ((y_i - mu) . v)^2`` and remove the ``floor(c f)`` rows of highest
score. ``F(X) = (1/|G|) sum_{i in G} x_i`` over the good set ``G``: the intersection of the rows
each iteration kept. When that intersection is empty (the paper leaves it undefined; its
reference codes average nothing), ``G`` is the rows removed by the fewest iterations, which is
the intersection whenever that is not empty.

``v`` is never formed: with ``Y - 1 mu^T = U S V^T``, ``(Y - 1 mu^T) v = s_1 u``, so
``s_i = lambda u_i^2`` with ``(lambda, u)`` the top eigenpair of the ``(n, n)`` float64 Gram
matrix of the centred rows (a deterministic ``eigh``). Memory: the ``(n, b)`` sub-matrix.

Defaults ``iters = 5``, ``c = 1`` (both the FLPoison and the Blades reference codes) and
``b = 10000`` (Blades'). The coordinates are drawn by a generator seeded with ``seed`` and
the rows' content (``aggregators._filtering``); the removals are decided on the rows in
content order (among equal scores the row of smaller digest goes first), so the good set is
exactly order-invariant. Needs ``n > 2f`` and fewer than ``n`` removals per iteration.
"""

from __future__ import annotations

import math

import torch

from robust.constraints import Interval, Param
from robust.geometry import weighted_sum
from robust.source import Rows, take_columns
from ._filtering import draws, in_input_order
from .base import SEED, Rule, register


@register
class DnC(Rule):
    name = "dnc"

    params = (
        Param("iters", Interval(int, 1, None), 5, "how many random subsets of coordinates are scored", tune=True),
        Param("b", Interval(int, 1, None), 10000, "how many coordinates each subset has"),
        Param("c", Interval(float, 0, None, "neither"), 1.0, "each subset removes floor(c * f) rows", tune=True),
        SEED,
    )

    def __init__(self, f: int, **params: object) -> None:
        super().__init__(f, **params)
        self.removed = math.floor(self.c * f)

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)
        if self.removed >= n:
            raise ValueError(
                f"dnc removes floor(c*f) = {self.removed} rows per subset, not fewer than the n={n} rows "
                f"(c={self.c}, f={self.f}): lower c"
            )

    def aggregate(self, X: Rows) -> torch.Tensor:
        n, d = X.shape
        order, gen = draws(X, self.name, self.seed)
        times_removed = torch.zeros(n, dtype=torch.long, device=X.device)
        # every subset drawn first, then read in one pass (the draws are the same); drawn on the
        # CPU (the generator's device, the same draws everywhere), the columns move with the reads
        subsets = [torch.randperm(d, generator=gen, device="cpu")[: self.b].sort().values for _ in range(self.iters)]
        chosen = torch.unique(torch.cat(subsets))
        values = take_columns(X, chosen)
        for columns in subsets:
            sub = values[:, torch.searchsorted(chosen, columns).to(X.device)][order].to(torch.float64)
            sub -= sub.mean(dim=0)
            eigvals, eigvecs = torch.linalg.eigh(sub @ sub.T)
            scores = eigvals[-1].clamp_min(0.0) * eigvecs[:, -1].square()
            worst = torch.sort(scores, descending=True, stable=True).indices[: self.removed]
            times_removed[worst] += 1
        good = times_removed == times_removed.min()
        self.last_kept = in_input_order(good, order)
        return weighted_sum(X, self.last_kept.to(torch.float64) / int(good.sum()))
