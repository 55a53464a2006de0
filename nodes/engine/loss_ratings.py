"""The loss score: what each row does to the loss of samples the coordinator holds.

Every other detector is geometric (norms, distances, cosines, a principal direction): a row
crafted to look geometrically typical passes them all (``evade``). This one asks what the row
*does*, as Templar's Gauntlet scores its peers (Covenant-72B): the coordinator steps the model
by each row at its share of the mean, as its protocol steps by an aggregate (``Protocol.apply``),
and measures the mean cross-entropy of the result on its root samples (``root = N``, FLTrust's
held-out set, ``nodes.engine.root``) against the model's own::

    effect_i = L_root(step(w, x_i / n)) - L_root(w)          (n rows this round)

Higher is more suspicious: an honest row lowers the held-out loss (a negative effect), a
label-flipper's or a backdoor's raises it or lowers it less. The rows are the ones the rule
reads (staleness weights applied). Cost: one forward pass over the ``N`` root samples per row,
on the CPU with the model; the stepped model is one ``(d,)`` vector at a time.

Why the share and not the whole row: one row moves the model ``n`` times as far as its weight
in a mean does, and a single node's row is noisy. Late in training such a step raises the
held-out loss for nearly every row (on the quick scenario the round's median effect turns
positive, +0.1 to +0.7 nats, from round 11 on), and it raises it most for the rows of nodes
whose data are one-class-heavy: honest, they scored as label-flippers do (z 10-17 against
flippers' 2-8 under ``mean``; a CUSUM of it quarantined 62 honest nodes on the digits quick grid
at a reference of 12). At its share the step stays where the loss is nearly linear in it, and
measures the row's direction against the root's loss: the same honest nodes stay under z 4,
the flippers at 3-12.

One round's effects are noisy (a node's batches, the root's few samples), so, as the Gauntlet
does, nodes are also rated across rounds (:class:`Ratings`): each round the nodes scored are
ranked by effect, lowest first, and rated as a free-for-all of one-player teams under
OpenSkill's Plackett-Luce model (Weng & Lin, JMLR 2011, "A Bayesian approximation method for
online ranking"; the ``openskill`` library), which keeps each node's skill as a mean ``mu`` and
an uncertainty ``sigma``. A node's rating is its ordinal ``mu - 3 sigma``: a newcomer's
(``25 - 3 * 25/3 = 0``) rises only as rounds show it helps. The ``loss-score`` rule
(``aggregators.loss_score``) averages the rows of the best-rated nodes.
"""

from __future__ import annotations

import torch
from openskill.models import PlackettLuce

from robust.models import Scorer
from robust.source import Rows

from .protocol import Protocol
from .root import Root


def effects(scorer: Scorer, protocol: Protocol, root: Root, w: torch.Tensor, buffer: torch.Tensor | None,
            X: Rows) -> torch.Tensor:
    """``effect_i`` of every row of ``X`` (float64 ``(n,)``, canonical order) from the global
    model ``w`` and the protocol's outer-momentum ``buffer``."""
    before = scorer.evaluate(w, root.x, root.y)[1]
    out = torch.empty(X.n, dtype=torch.float64)
    for i in range(X.n):
        stepped, _ = protocol.apply(w, X.row(i).to(w.dtype) / X.n, buffer)
        out[i] = scorer.evaluate(stepped, root.x, root.y)[1] - before
    return out


class Ratings:
    """Each node's OpenSkill Plackett-Luce rating over the rounds it was scored in."""

    def __init__(self) -> None:
        self.model = PlackettLuce()
        self.table: dict[str, tuple[float, float]] = {}  # node -> (mu, sigma)

    def update(self, ids: list[str], effects: torch.Tensor) -> None:
        """Rate one round: the nodes ``ids`` ranked by their ``effects`` (lower is better; equal
        effects share a rank). A round of fewer than two nodes ranks nobody."""
        if len(ids) < 2:
            return
        values = effects.tolist()
        rank = {v: k + 1 for k, v in enumerate(sorted(set(values)))}
        ranks = [rank[v] for v in values]
        teams = [[self.model.rating(*self.table.get(i, (self.model.mu, self.model.sigma)), name=i)] for i in ids]
        for i, (rated,) in zip(ids, self.model.rate(teams, ranks=ranks)):
            self.table[i] = (rated.mu, rated.sigma)

    def ordinals(self, ids: list[str]) -> torch.Tensor:
        """``mu - 3 sigma`` of each node of ``ids`` (float64; a node never rated: 0)."""
        return torch.tensor([mu - 3 * sigma for mu, sigma in (self.table.get(i, (self.model.mu, self.model.sigma))
                                                              for i in ids)], dtype=torch.float64)

    def state(self) -> dict:
        """The table, for a checkpoint (:meth:`load_state` restores it)."""
        return {"ids": sorted(self.table), "rating": torch.tensor([self.table[i] for i in sorted(self.table)],
                                                                   dtype=torch.float64).reshape(-1, 2)}

    def load_state(self, state: dict) -> None:
        self.table = {i: (float(mu), float(sigma)) for i, (mu, sigma) in zip(state.get("ids", []),
                                                                               state.get("rating", torch.zeros(0, 2)).tolist())}
