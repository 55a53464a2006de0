"""FLTrust (Cao, Fang, Liu & Gong, NDSS 2021, "FLTrust: Byzantine-robust federated learning
via trust bootstrapping").

The server computes its own update ``g0`` on a small clean root data set (``RoundInputs.reference``,
same protocol, sign and scale as a row) and trusts each row by its direction:

    TS_i = ReLU(cos(x_i, g0)),    x_i' = x_i ||g0|| / ||x_i||,
    F(X) = sum_i TS_i x_i' / sum_i TS_i.

A zero row (or a zero ``g0``) has cosine 0. When every ``TS_i`` is 0 (every row at 90 degrees
or more from ``g0``) nothing is trusted and ``F`` is the zero vector (FLPoison falls back to
the plain mean of the rescaled rows instead: that would hand the round to the rows the
server just distrusted). ``last_kept``: ``TS_i > 0``; ``last_weights``: ``TS_i`` (float64, rows'
order).

The trust comes from the root data, not from a majority: any ``n >= 1`` is served and ``f``
is unused (it is only the chain's contract). The cosines are computed in float64 over column
blocks on the rows in content order (``aggregators._filtering``), so ``TS`` and the kept set
are exactly order-invariant; the weighted sum runs over the rows in their own order, in float64
over column blocks: the aggregate is order-invariant up to rounding. No state.
"""

from __future__ import annotations

import torch

from robust.geometry import pow2_scale, weighted_sum
from robust.source import Rows

from ._filtering import F64, content_order
from .base import RoundInputs, Rule, register


def cosines_and_norms(X: Rows, order: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos(x_i, u), ||x_i||)`` in float64 for the rows ``X[order]``, ``u`` a float64 unit
    vector, one pass over the blocks. A zero row has cosine 0. Rows whose float64 squares
    overflow (float64 values above ~1e154) are recomputed exactly scaled by a power of two."""
    n = X.n
    dots = torch.zeros(n, dtype=F64, device=X.device)
    sq = torch.zeros(n, dtype=F64, device=X.device)
    for s, block in X.blocks():
        block = block[order].to(F64)
        dots += (block * u[s : s + block.shape[1]]).sum(dim=1)  # not a matrix-vector product: its bits depend on the row's place
        sq += block.square().sum(dim=1)
    norms = sq.sqrt()
    cos = torch.where(norms > 0, dots / torch.where(norms > 0, norms, 1.0), 0.0)
    for i in (~torch.isfinite(norms) | ~torch.isfinite(dots)).nonzero().flatten().tolist():
        row = X.row(int(order[i])).to(F64)
        c = pow2_scale(row)
        row *= c
        scaled = torch.linalg.vector_norm(row)
        cos[i], norms[i] = (row @ u) / scaled, scaled / c  # ||x_i|| may still be inf
    return cos.clamp(-1.0, 1.0), norms


@register
class FLTrust(Rule):
    name = "fltrust"
    uses_f = False
    needs = frozenset({"reference"})

    def check_n(self, n: int) -> None:
        self._require(n >= 1, ">= 1", n)

    def aggregate(self, X: Rows, inputs: RoundInputs) -> torch.Tensor:
        g0 = inputs.reference.detach().to(device=X.device, dtype=F64)
        c0 = pow2_scale(g0)
        scaled = torch.linalg.vector_norm(g0 * c0)  # neither overflows nor underflows
        g0_norm = scaled / c0
        u = g0 * c0 / scaled if scaled > 0 else torch.zeros_like(g0)
        order, _ = content_order(X)
        cos, norms = cosines_and_norms(X, order, u)
        trust = cos.clamp_min(0.0)  # ReLU
        self.last_weights = torch.empty_like(trust)
        self.last_weights[order] = trust
        self.last_kept = self.last_weights > 0
        total = trust.sum()
        if total == 0:
            return torch.zeros(X.shape[1], dtype=X.dtype, device=X.device)
        # trust > 0 implies ||x_i|| > 0; an infinite norm rescales its row to zero weight
        scale = torch.where(trust > 0, trust * g0_norm / torch.where(trust > 0, norms, 1.0), 0.0) / total
        weights = torch.empty_like(scale)
        weights[order] = scale
        return weighted_sum(X, weights)
