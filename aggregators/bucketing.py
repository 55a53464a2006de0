"""Bucketing (Karimireddy, He & Jaggi, ICLR 2022, "Byzantine-robust learning on
heterogeneous datasets via bucketing").

Rows are shuffled by a permutation seeded with ``seed`` and averaged in consecutive buckets
of ``s`` rows (the last bucket may be smaller): ``y_b = mean_{i in bucket b} x_pi(i)``, giving
``ceil(n/s)`` rows. The next rule keeps the same f. The permutation depends only on
``(seed, n)``, so the same input gives the same output; vary ``seed`` per round for fresh
buckets.
"""

from __future__ import annotations

import torch

from robust.constraints import Interval, Param
from robust.source import Rows, mixed
from .base import SEED, PreAggregator, register


@register
class Bucketing(PreAggregator):
    name = "bucketing"
    uses_f = False
    keeps_rows = False

    params = (Param("s", Interval(int, 1, None), 2, "the bucket size: rows averaged into one", tune=True), SEED)

    def rows(self, n: int) -> int:
        return -(-n // self.s)

    def transformed(self, X: Rows) -> Rows:
        # the (n', n) mixing is built on the CPU, whose seeded draw is the same on every machine;
        # ``mixed`` moves it to the rows' device
        n, cpu = X.n, "cpu"
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed), device=cpu)
        bucket = torch.empty(n, dtype=torch.long, device=cpu)
        bucket[perm] = torch.arange(n, device=cpu) // self.s
        sizes = torch.bincount(bucket, minlength=self.rows(n)).to(torch.float64)
        means = torch.zeros(self.rows(n), n, dtype=torch.float64, device=cpu)
        means[bucket, torch.arange(n, device=cpu)] = 1.0 / sizes[bucket]
        return mixed(X, means)
