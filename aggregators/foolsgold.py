"""FoolsGold (Fung, Yoon & Beschastnikh, RAID 2020, "The limitations of federated learning in
sybil settings").

Every node ``i`` has a history ``H_i``: the sum of the rows it sent, this round's included.
Over the nodes present this round:

    cs_ij = cos(H_i, H_j) (j != i),  cs_ii = 0,     v_i = max_j cs_ij
    cs_ij <- cs_ij v_i / v_j  where v_j > v_i        (pardoning)
    a_i = clip(1 - max_j cs_ij, 0, 1),  a <- a / max_j a_j,  a_i <- 0.99 where a_i = 1
    a_i <- clip(kappa (ln(a_i / (1 - a_i)) + 0.5), 0, 1)    (a_i = 0 stays 0)
    F(X) = sum_i a_i x_i / sum_i a_i                 (the zero vector when every a_i is 0)

Sybils that push one goal send alike rows round after round: their histories align, their
largest similarity nears 1 and their weight 0, while honest nodes with different data keep
diverse histories. ``last_kept``: ``a_i > 0``; ``last_weights``: ``a`` (float64, rows' order).

As in the reference code (``cs - I``), the diagonal counts as 0 rather than being skipped, so
``v_i >= 0``: the pardoning ratios lie in [0, 1) and never divide by zero, and ``1 - max_j cs_ij``
after the clip is the paper's. Unlike the reference codes, which return ``sum_i a_i x_i``
(``a_i`` as a per-node learning rate, so the step grows with the number of nodes), the
weighted sum is divided by ``sum_i a_i``: the aggregate is in row units like every other
rule's. The paper's optional weighting of "indicative features" (read off the model's output
layer) is left out: a row is a flat vector whose layout the rule does not know. Rows enter
the history as sent (FLPoison first clips them to norm 1; the paper and its code do not).

The similarities are computed from the histories sorted by node id, in float64 over column
blocks, so the weights are the same bits for the same rows and ids in any order; the weighted
sum runs over the rows in their own order (float64, column blocks): the aggregate is
order-invariant up to rounding. One pass over the round's rows and the old histories writes
the new histories and accumulates their Gram matrix; a second pass over the rows makes the
weighted sum (a third, over the new histories, only when a history's float64 squares overflow).

Memory: one ``(d,)`` history per node ever seen, in its rows' dtype, kept for the whole run (a
node absent from a round keeps its history and is compared again when it returns), plus the
``(n, n)`` similarities. After ``spill(store)`` (``robust.rowstore``) the histories are rows on
disk, written block by block: memory is then ``n x BLOCK`` per source read (the rows, the old
histories) and the disk holds up to ``2 x nodes`` rows (old and new until the owner collects).
Any ``n >= 1`` is served; ``f`` is unused (only the chain's contract). State: ``"history.<id>"``
per node: the row, or with a store its 32-byte reference.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.geometry import pow2_scale, weighted_sum
from robust.row_keeper import Handle, Keeper, lockstep, rows_of
from robust.source import Rows

from ._filtering import F64
from .base import RoundInputs, Rule, register


def _add_gram(gram: torch.Tensor, block: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    block = block.to(F64) if scale is None else block.to(F64) * scale[:, None]
    gram += block @ block.T


def cosine_matrix(rows: Rows, gram: torch.Tensor) -> torch.Tensor:
    """``(n, n)`` float64 cosine similarities of ``rows`` (a zero row: 0 with every row) from
    their Gram matrix ``gram`` (float64, accumulated over column blocks by :func:`_add_gram`);
    a row whose float64 squares overflow (values above ~1e154) is scaled by
    a power of two and the Gram matrix accumulated again (one more pass), which leaves its
    cosines unchanged."""
    bad = (~torch.isfinite(gram.diagonal())).nonzero().flatten().tolist()
    if bad:
        scale = torch.ones(rows.n, dtype=F64, device=rows.device)
        scale[bad] = torch.stack([pow2_scale(rows.row(i)) for i in bad])
        gram = torch.zeros_like(gram)
        for _, block in rows.blocks():
            _add_gram(gram, block, scale)
    norms = gram.diagonal().sqrt()
    outer = norms[:, None] * norms[None, :]
    positive = outer > 0
    return torch.where(positive, gram / torch.where(positive, outer, 1.0), 0.0).clamp(-1.0, 1.0)

def foolsgold_weights(cs: torch.Tensor, kappa: float) -> torch.Tensor:
    """The weights ``a`` (float64 ``(n,)``) from the similarities ``cs`` (see the module docstring)."""
    cs = cs.clone()
    cs.fill_diagonal_(0.0)
    v = cs.max(dim=1).values
    pardon = v[None, :] > v[:, None]  # [i, j]: v_j > v_i, so v_j > 0
    cs = torch.where(pardon, cs * (v[:, None] / torch.where(pardon, v[None, :], 1.0)), cs)
    a = (1.0 - cs.max(dim=1).values).clamp(0.0, 1.0)
    top = a.max()
    if top > 0:
        a = a / top
    a = torch.where(a == 1.0, 0.99, a)
    logit = kappa * (torch.log(torch.where(a > 0, a, 1.0) / (1.0 - a)) + 0.5)
    return torch.where(a > 0, logit, 0.0).clamp(0.0, 1.0)


@register
class FoolsGold(Rule):
    name = "foolsgold"
    uses_f = False
    needs = frozenset({"ids"})

    params = (Param("kappa", Interval(float, 0, None, "neither"), 1.0,
                    "the slope of the logit from dissimilarity to weight", tune=True),)

    def __init__(self, f: int, **params: object) -> None:
        super().__init__(f, **params)
        self.keeper = Keeper()
        self.history: dict[str, Handle] = {}

    def check_n(self, n: int) -> None:
        self._require(n >= 1, ">= 1", n)

    def kept_rows(self, nodes: int) -> int:
        return 2 * nodes

    def reset(self) -> None:
        """Forget every node's history."""
        self.history = {}

    def state(self) -> dict[str, torch.Tensor]:
        return {f"history.{k}": self.keeper.state(v) for k, v in self.history.items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.history = {k[len("history."):]: self.keeper.load(v) for k, v in state.items() if k.startswith("history.")}

    def aggregate(self, X: Rows, inputs: RoundInputs) -> torch.Tensor:
        n, d = X.shape
        ids = inputs.ids
        known = next(iter(self.history.values()), None)
        if known is not None and self.keeper.size(known) != (d, X.dtype):
            kd, kind = self.keeper.size(known)
            held, now = (f"of d={kd} coordinates", f"d={d}") if kd != d else (f"in {kind}", f"{X.dtype} rows")
            raise ValueError(f"foolsgold holds histories {held}, now {now}: build a new aggregator (or reset()) "
                             "for a new model")
        order = sorted(range(n), key=ids.__getitem__)
        weights = foolsgold_weights(self._histories([ids[i] for i in order], X, order), self.kappa)
        index = torch.tensor(order, dtype=torch.long, device=X.device)
        self.last_weights = torch.empty_like(weights)
        self.last_weights[index] = weights
        self.last_kept = self.last_weights > 0
        total = weights.sum()
        if total == 0:
            return torch.zeros(d, dtype=X.dtype, device=X.device)
        scale = torch.empty_like(weights)
        scale[index] = weights / total
        return weighted_sum(X, scale)

    def _histories(self, nodes: list[str], X: Rows, order: list[int]) -> torch.Tensor:
        """Add the rows ``X[order]`` to the histories of ``nodes`` (new rows, written block by
        block: a state handed out stays as it was) and return the new histories' cosines, from
        one pass over ``X`` and the old histories."""
        old = [j for j, node in enumerate(nodes) if node in self.history]
        sources = [X] + ([self.keeper.source([self.history[nodes[j]] for j in old], X.device)] if old else [])
        gram = torch.zeros(len(nodes), len(nodes), dtype=F64, device=X.device)
        with self.keeper.writing(len(nodes), X.d, X.dtype, X.device) as new:
            for _, (block, *history) in lockstep(*sources):
                block = rows_of(block, order)  # the block is ours: the sums are made in place
                if history:
                    if len(old) == len(nodes):
                        block += history[0]  # x + h: the bits of h + x
                    else:
                        block[old] += history[0]
                new.add(block)
                _add_gram(gram, block)
        self.history.update(zip(nodes, new.handles))
        return cosine_matrix(self.keeper.source(new.handles, X.device), gram)
