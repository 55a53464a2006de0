"""Drift: a patient attacker. A bias too small to trip any per-round test, the same every
round, toward one class.

Every Byzantine row is the honest mean plus a constant nudge:

    x = mean(H) + eps N sigma u,        N = median_i ||h_i||

``u`` is the unit vector of the output layer's bias for class ``target`` (the last trained
parameter of the model, found through ``Context.layout``), ``sigma`` the protocol's
``Context.step_sign`` (+1 when the server moves the model along the aggregate, ``delta``;
-1 when against it, ``momentum``), so the target's logit, hence its predicted share, rises a
little every round. ``eps`` is relative to the honest rows' typical (median) norm: the nudge
is ``eps`` of an honest row, below the rows' own spread. ``u`` needs no honest row and no
label: it is fixed for the run.

The honest nodes keep training against the bias, so it settles where their pull back
balances it: a small push buys a small, lasting shift. Rows equal to the honest mean are
more typical than any honest row (a direction detector sees that); ``spread=1`` gives them
the honest rows' own per-coordinate scatter.

Default ``eps=1``, its strongest and quietest measured (``evaluation/scenarios/adaptive.toml``:
the quick scenario, 5 defences, seeds 0-3): 0.3 pp of final accuracy on average over the
defences at a best-detector AUC of 0.62, where ``eps`` 0.05, 0.2 and 0.5 cost none (each
made Krum 15 pp better) and were seen at AUC 1.00, 0.99 and 0.80, ``eps=2`` cost none at AUC
1.00, and ``eps=1,spread=1`` none at 0.92. On digits drift moves accuracy little at any
``eps``: its harm is the target class's share, which a run's accuracy does not show.
"""

from __future__ import annotations

import math

import torch

from robust.constraints import Interval, Param

from .base import Context, OmniscientAttack, register


@register
class Drift(OmniscientAttack):
    name = "drift"

    params = (
        Param("eps", Interval(float, 0, None, "neither"), 1.0, "the nudge, in honest-row norms"),
        Param("target", Interval(int, 0, None), 0, "the class to favour"),
    )

    def coordinate(self, ctx: Context, d: int) -> int:
        """The row's coordinate of the output bias for class ``target``."""
        if ctx.layout is None or ctx.step_sign is None:
            raise ValueError("drift needs the model's layout and the protocol's step sign: pass "
                             "Context.layout and Context.step_sign")
        name, shape = ctx.layout[-1]
        size = sum(math.prod(s) for _, s in ctx.layout)
        if size != d:
            raise ValueError(f"drift: Context.layout describes {size} values, the rows have {d}")
        if len(shape) != 1:
            raise ValueError(f"drift needs the model's last parameter to be the output layer's bias "
                             f"(got {name!r} of shape {tuple(shape)})")
        if self.target >= shape[0]:
            raise ValueError(f"drift target={self.target} but the output layer has {shape[0]} classes: lower target")
        return d - shape[0] + self.target

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        i = self.coordinate(ctx, H.shape[1])
        row = H.mean(dim=0)
        row[i] += self.eps * H.norm(dim=1).median() * ctx.step_sign
        return row
