"""The loss score: what each row does to the loss of samples the coordinator holds.

Every other detector is geometric (norms, distances, cosines, a principal direction): a row
crafted to look geometrically typical passes them all (``evade``). This one asks what the row
*does*, as Templar's Gauntlet scores its peers (Covenant-72B): the coordinator steps the model
by each row alone, as its protocol steps by an aggregate (``Protocol.apply``), and measures the
mean cross-entropy of the result on its root samples (``root = N``, FLTrust's held-out set,
``nodes.engine.root``) against the model's own::

    effect_i = L_root(step(w, x_i)) - L_root(w)

Higher is more suspicious: an honest row lowers the held-out loss (a negative effect), a
label-flipper's or a backdoor's raises it or lowers it less. The rows are the ones the rule
reads (staleness weights applied). Cost: one forward pass over the ``N`` root samples per row,
on the CPU with the model; the stepped model is one ``(d,)`` vector at a time.
"""

from __future__ import annotations

import torch

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
        stepped, _ = protocol.apply(w, X.row(i).to(w.dtype), buffer)
        out[i] = scorer.evaluate(stepped, root.x, root.y)[1] - before
    return out
