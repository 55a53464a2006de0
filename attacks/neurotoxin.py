"""``neurotoxin:k,target,fraction,size,value,gamma,stop_after``: a backdoor hidden in the
coordinates honest nodes rarely update.

Zhang et al., ICML 2022, "Neurotoxin: durable backdoors in federated learning". The node
poisons its data as ``backdoor`` does (same trigger, target and parameters). Then, at every
local step, it projects its gradient off the coordinates the honest nodes are currently
moving most, as seen in the last global update it observed::

    delta = w_t - w_prev          (the model it is sent now minus the one it was sent last round)
    S     = top-k% coordinates of |delta|      (ceil(k / 100 * d) of them)
    g    <- g * 1[i not in S]     (each step's gradient, before the local momentum)

so the backdoor lives where honest updates do not overwrite it, and survives after the
attacker stops (``stop_after=R``: from round ``R + 1`` on the node is honest: no poisoning,
no projection, no scaling). A real attacker knows only the models it was sent: ``w_prev``
is the model of its previous round, kept in the node's memory (``remembers``); in its first
round, or when it did not take part in round ``t - 1``, there is no mask.

``k`` defaults to 5 (percent): the authors' code runs its CIFAR and Reddit experiments
with ``gradmask_ratio=0.95`` (keep the bottom 95% of coordinates). Their code can also
project the update onto the server's norm ball (``--PGD``); here ``gamma`` scales it as
``backdoor`` does (1: no scaling), and ``constrain-scale`` aims at a norm.
Under the ``delta`` protocol every step's update, hence the row, is zero on ``S``; under
``momentum`` only the fresh gradient is projected (the worker momentum keeps its past).
"""

from __future__ import annotations

import math

import torch

from robust.constraints import Interval, Param

from .base import Memory, Shaping, register
from .backdoor import Backdoor


def keep_mask(delta: torch.Tensor, k: float) -> torch.Tensor:
    """``1`` off, ``0`` on the ``ceil(k% d)`` coordinates of largest ``|delta|`` (only those
    that moved: a model that did not move masks nothing)."""
    top = torch.topk(delta.abs(), math.ceil(k / 100 * delta.numel()), sorted=False).indices
    keep = torch.ones_like(delta)
    keep[top[delta[top] != 0]] = 0.0
    return keep


@register
class Neurotoxin(Backdoor):
    name = "neurotoxin"
    remembers = True  # the model it was sent last round

    params = (Param("k", Interval(float, 0, 100, "neither"), 5.0, "the percent of coordinates masked"),)  # + backdoor's

    def shaping(self, round: int, w: torch.Tensor, last: Memory | None) -> Shaping | None:
        if not self.active(round) or last is None or last.round != round - 1:
            return None  # no global update observed: the previous round is not its own
        keep = keep_mask(w - last.w.to(w.device, w.dtype), self.k)
        return Shaping(grad=lambda g: g * keep)
