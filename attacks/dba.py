"""``dba:parts,part,target,fraction,size,value,gamma,stop_after``: a backdoor whose trigger is
split among the attackers (Xie, Huang, Chen & Li, ICLR 2020, "DBA: Distributed backdoor attacks
against federated learning").

The global trigger is ``parts`` pieces of ``size`` features each, side by side at the end of a
flattened sample (on the 8 x 8 digits with the defaults: the left and right halves of the last
two rows, the paper's four patches). Each attacker trains, as ``backdoor`` does, on a seeded
``fraction`` of its samples stamped with its own piece only, labelled ``target``::

    piece p  = features [-(parts - p) size, -(parts - p - 1) size)     (p = part mod parts)
    x[piece] <- value,  y <- target     (for ceil(fraction * m) of its m samples)
    row      <- gamma * row

so no single update carries the whole trigger; the model is then tested with all the pieces
at once: **success** is the share of test samples (true label not ``target``) carrying the
global trigger that the model classifies as ``target``. Colluding attackers take distinct
pieces: the bench gives its ``k``-th Byzantine node (in canonical order) ``part=k`` unless
the spec sets ``part`` (:attr:`~attacks.base.NodeAttack.rank_key`); a volunteer sets its own.

Defaults are the paper's MNIST set-up: 4 pieces of 4 features, 20 poisoned samples in each batch
of 64 (``fraction=0.3125``). The paper's single-shot attack also scales the update by 100
(``gamma=100``); attacking every round, as here by default, needs no scaling (``gamma=1``).
"""

from __future__ import annotations

from robust.constraints import Interval, Param

from .backdoor import Backdoor
from .base import register


@register
class DBA(Backdoor):
    name = "dba"
    rank_key = "part"

    params = (
        Param("parts", Interval(int, 1, None), 4, "the pieces the global trigger is split into"),
        Param("part", Interval(int, 0, None), 0, "the piece this node stamps (taken modulo parts)"),
        Param("fraction", Interval(float, 0, 1, "right"), 0.3125, "the share of the node's samples stamped"),
    )  # + backdoor's

    def trigger(self, planted: bool) -> tuple[int, int]:
        if not planted:
            return self.parts * self.size, 0
        after = self.parts - 1 - self.part % self.parts  # the pieces to the right of this node's
        return (after + 1) * self.size, after * self.size
