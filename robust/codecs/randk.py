"""``randk:k=0.01``: random-k sparsification, ``m = max(1, ceil(k d))`` coordinates drawn uniformly.

The coordinates are ``m`` distinct indices drawn (without replacement, then sorted) by a
generator seeded from the caller's ``key`` (``robust.seeds.generator(*key, "randk")``): the
same key gives the same indices and bits, and the coordinator needs no key to decode. The values
are rescaled so the decoded row is unbiased:

    C(x)_j = (d / m) x_j  if j is drawn, else 0;   P(j drawn) = m / d,   so  E[C(x)] = x

at the price of variance ``E||C(x) - x||^2 = (d/m - 1) ||x||^2`` (Stich, Cordonnier & Jaggi,
NeurIPS 2018; Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed
Optimization", NeurIPS 2018). Being unbiased it needs no error feedback. The node sends the raw
values ``x_j``; decoding applies ``d / m`` (float64 product, one rounding to float32).
"""

from __future__ import annotations

import torch

from robust.seeds import generator

from .base import Encoded, register
from .sparse import SparseCodec


@register
class RandK(SparseCodec):
    name = "randk"
    keyed = True

    def gain(self, d: int) -> float:
        return d / self.count(d)

    def _encode(self, row: torch.Tensor, key: tuple) -> Encoded:
        if not key:
            raise ValueError("randk draws its coordinates from a key: pass key=(run seed, round, node id), "
                             "so nodes and rounds draw different coordinates")
        d = row.numel()
        idx = torch.randperm(d, generator=generator(*key, "randk"))[: self.count(d)]
        return self._pack(row, idx.sort().values)
