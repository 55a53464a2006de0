"""Fang et al.'s aggregator-tailored attacks (USENIX Security 2020, "Local model poisoning
attacks to Byzantine-robust federated learning"), full-knowledge variants, in update space
(the current global model is the origin).

Let ``s = sign(mean(H))`` (zero counted as +1): the direction the honest nodes move the model.

- ``fang-krum``: all Byzantine rows are ``-lambda * s``, with ``lambda`` halved from the
  paper's upper bound ``1/((n-2f-1) sqrt(d)) min_i sum_{l in N_i} ||h_l - h_i|| +
  max_i ||h_i|| / sqrt(d)`` (``N_i`` the ``n-f-2`` honest rows nearest ``h_i``) until the
  deployed aggregator returns the Byzantine row (at most ``halvings`` times).
- ``fang-trimmed-mean`` (also against the median): per coordinate, with ``w_max``/``w_min``
  the honest maximum/minimum and ``b = 2``, each Byzantine value is drawn uniformly from
  ``[w_max, b w_max]`` (or ``[w_max / b, w_max]`` if ``w_max <= 0``) where ``s_j < 0``, and
  from ``[w_min / b, w_min]`` (or ``[b w_min, w_min]`` if ``w_min <= 0``) where ``s_j > 0``.
"""

from __future__ import annotations

import math

import torch

from robust.constraints import Interval, Param
from robust.geometry import sq_distances

from .base import Context, OmniscientAttack, register


def direction(H: torch.Tensor) -> torch.Tensor:
    return torch.where(H.mean(dim=0) < 0, -1.0, 1.0).to(H.dtype)


@register
class FangKrum(OmniscientAttack):
    name = "fang-krum"

    params = (Param("halvings", Interval(int, 0, None), 20, "times the step is halved until Krum picks the rows"),)

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        h, d = H.shape
        s = direction(H)
        dist = sq_distances(H).sqrt()
        k = max(min(ctx.n - self.f - 2, h - 1), 0)
        nearest = torch.sort(dist, dim=1).values[:, 1 : k + 1].sum(dim=1)  # column 0: itself
        denom = max(ctx.n - 2 * self.f - 1, 1)
        lam = float(nearest.min()) / (denom * math.sqrt(d)) + float(H.norm(dim=1).max()) / math.sqrt(d)
        for _ in range(self.halvings):
            B = (-lam * s).expand(self.f, -1)
            if torch.equal(ctx.aggregate(torch.cat([H, B])), B[0]):
                break
            lam /= 2
        return -lam * s


@register
class FangTrimmedMean(OmniscientAttack):
    name = "fang-trimmed-mean"

    def craft(self, H: torch.Tensor, ctx: Context) -> torch.Tensor:
        s = direction(H)
        w_max, w_min = H.max(dim=0).values, H.min(dim=0).values
        # s < 0: values between w_max and b w_max (or w_max / b if w_max <= 0), all >= w_max;
        # s > 0: values between w_min and w_min / b (or b w_min if w_min <= 0), all <= w_min
        near = torch.where(s < 0, w_max, w_min)
        far = torch.where(
            s < 0,
            torch.where(w_max > 0, 2 * w_max, w_max / 2),
            torch.where(w_min > 0, w_min / 2, 2 * w_min),
        )
        u = torch.rand(self.f, H.shape[1], generator=ctx.generator, dtype=H.dtype).to(H.device)
        return near + u * (far - near)
