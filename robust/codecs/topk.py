"""``topk:k=0.01``: top-k sparsification, the ``m = max(1, ceil(k d))`` largest-magnitude coordinates.

``C(x)_j = x_j`` if ``|x_j|`` is among the ``m`` largest, else 0; ties at the threshold go to
the lowest indices, so the kept set (and the bits) depend on the row alone. ``||x - C(x)||^2 <=
(1 - k) ||x||^2``, but ``C`` is biased: a coordinate that is never among the largest is never
sent. A node therefore encodes with error feedback (:func:`robust.codecs.error_feedback`), which
re-adds what earlier rounds left out: Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory"
(NeurIPS 2018); Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes" (ICML 2019). Wire format: :mod:`robust.codecs.sparse`.
"""

from __future__ import annotations

import torch

from .base import Encoded, register
from .sparse import SparseCodec


@register
class TopK(SparseCodec):
    name = "topk"
    biased = True

    def _encode(self, row: torch.Tensor, key: tuple) -> Encoded:
        m = self.count(row.numel())
        size = row.abs()
        threshold = torch.topk(size, m, sorted=False).values.min()  # the m-th largest |x|: a value, so deterministic
        above = size > threshold
        tied = size == threshold
        # fill the places left after the strictly larger ones with the lowest-indexed ties
        keep = above | (tied & (tied.cumsum(0) <= m - int(above.sum())))
        return self._pack(row, keep.nonzero().flatten())  # nonzero is ascending
