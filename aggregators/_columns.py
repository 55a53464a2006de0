"""Per-coordinate order statistics: sort every column of ``X`` in cache-sized blocks.

Every coordinate-wise rule (median, trimmed mean, MeaMed, Bulyan's second stage) reads the
sorted values of each column. Sorting is done on transposed blocks of ``BLOCK`` columns so
the extra memory is O(n * BLOCK), blocks run on all of torch's threads, and the reduction of
a sorted block is a function of the *sorted* values only, so the result is bitwise the same
for any order of the rows.

On CPU the sort is NumPy's (vectorised AVX-512/AVX2 sort: 9x faster than ``torch.sort`` on a
(1e6, 100) block here); on CUDA it is ``torch.sort``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCK = 4096


def reduce_sorted_columns(
    X: torch.Tensor,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[j] = reduce(sorted column j of X[rows])``, computed on blocks.

    ``reduce`` receives a ``(b, m)`` tensor whose rows are the sorted columns of a block and
    returns ``(b,)`` values (any float dtype); the result has ``X``'s dtype and device.
    ``rows`` (default: all) selects the rows without copying ``X``.
    """
    d = X.shape[1]
    out = torch.empty(d, dtype=X.dtype, device=X.device)

    def work(start: int) -> None:
        block = X[:, start : start + BLOCK]
        # clone, not contiguous(): a column-major X would hand back its own memory to sort
        block = (block if rows is None else block[rows]).T.clone(memory_format=torch.contiguous_format)
        if block.is_cuda:
            block = torch.sort(block, dim=1).values
        else:
            block.numpy().sort(axis=1)
        out[start : start + BLOCK] = reduce(block)

    starts = range(0, d, BLOCK)
    if X.is_cuda or torch.get_num_threads() == 1 or len(starts) == 1:
        for s in starts:
            work(s)
    else:
        with ThreadPoolExecutor(torch.get_num_threads()) as pool:
            list(pool.map(work, starts))
    return out + 0.0  # -0.0 -> +0.0, so signed zeros cannot reveal the row order


def median_of_sorted(S: torch.Tensor) -> torch.Tensor:
    """Median of each row of sorted ``S``; even count -> mean of the two middle values (float64)."""
    m = S.shape[1]
    lo = S[:, (m - 1) // 2].to(torch.float64)
    hi = S[:, m // 2].to(torch.float64)
    return 0.5 * lo + 0.5 * hi


def mean_closest_to_median(S: torch.Tensor, k: int) -> torch.Tensor:
    """Mean of the ``k`` values of each sorted row closest to its median (float64).

    The ``k`` closest values form a window ``[s, s+k)`` of the sorted row; the window slides
    right while the value it would take in is strictly closer to the median than the one it
    would drop, so ties keep the smaller value. The slide test is monotone in ``s``, hence
    ``s`` is the number of positions where it holds.
    """
    m = S.shape[1]
    med = median_of_sorted(S)[:, None]
    slide = (med - S[:, : m - k].to(torch.float64)) > (S[:, k:].to(torch.float64) - med)
    start = slide.sum(dim=1, keepdim=True)
    window = S.gather(1, start + torch.arange(k, device=S.device))
    return window.to(torch.float64).sum(dim=1) / k
