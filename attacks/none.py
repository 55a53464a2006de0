"""``none``: the Byzantine nodes send their own honest updates: the clean reference run.

Not an attack but the baseline of the benchmark: every damage is measured against a run whose
``f`` Byzantine rows are ``own`` (the ``(f, d)`` updates those nodes computed honestly), so
that the clean and the attacked runs differ only in what the Byzantine nodes send.
"""

from __future__ import annotations

import torch

from .base import Context, OmniscientAttack, register


@register
class NoAttack(OmniscientAttack):
    name = "none"

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        if ctx.own is None:
            raise ValueError("'none' sends the Byzantine nodes' own updates: pass them as Context.own")
        return ctx.own
