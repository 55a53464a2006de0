"""The exhaustive search over subsets of ``n - f`` rows that MDA and SMEA share: a
:class:`SubsetRule` scores every subset from the rows' exact squared distances and averages
the best one.

Every subset is named by the ``f`` rows it excludes, visited in lexicographic order of those,
``BATCH`` at a time as a ``(B, f)`` tensor for the rule's vectorised score. The scores of all
``C(n, f)`` subsets are kept (``MAX_SUBSETS`` float64 values: 8 MB at most), so the winner is
the first subset in that order whose score is within ``rtol`` of the smallest: exact ties for
a score read from one matrix (``rtol=0``), and a stated slack for one that LAPACK computes,
whose last bits may differ between machines.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

from robust.geometry import sq_distances, weighted_sum
from .base import Rule

MAX_SUBSETS = 1_000_000
BATCH = 4096


def check_count(name: str, n: int, f: int, instead: str) -> None:
    """Raise ``ValueError`` when ``C(n, f)`` subsets exceed :data:`MAX_SUBSETS`; ``instead``
    names a rule to use then."""
    count = math.comb(n, f)
    if count > MAX_SUBSETS:
        raise ValueError(
            f"{name} would examine C(n={n}, f={f}) = {count:,} subsets, above its limit of "
            f"{MAX_SUBSETS:,}: lower f, or use an approximate rule such as {instead}"
        )


def best_kept(n: int, f: int, score: Callable[[torch.Tensor], torch.Tensor], device: torch.device,
              rtol: float = 0.0) -> torch.Tensor:
    """The rows kept (bool ``(n,)``) by the subset of least ``score``: ``score`` maps the excluded
    rows of a batch, ``(B, f)`` long, to ``(B,)`` float64 scores."""
    combos = itertools.combinations(range(n), f)
    scores = []
    while batch := list(itertools.islice(combos, BATCH)):
        excluded = torch.tensor(batch, dtype=torch.long, device=device).reshape(len(batch), f)
        scores.append(score(excluded).cpu())
    scores = torch.cat(scores)
    low = scores.min()
    first = int(torch.nonzero(scores <= low + rtol * low.abs()).flatten()[0])
    keep = torch.ones(n, dtype=torch.bool, device=device)
    keep[list(next(itertools.islice(itertools.combinations(range(n), f), first, None)))] = False
    return keep


def alive(excluded: torch.Tensor, n: int) -> torch.Tensor:
    """Which rows each subset keeps, bool ``(B, n)``, from its excluded rows ``(B, f)``."""
    out = torch.ones(excluded.shape[0], n, dtype=torch.bool, device=excluded.device)
    return out.scatter_(1, excluded, False)


def kept_rows(excluded: torch.Tensor, n: int) -> torch.Tensor:
    """The rows each subset keeps, ``(B, n - f)`` in increasing order, from its excluded rows
    ``(B, f)``."""
    return alive(excluded, n).nonzero()[:, 1].reshape(excluded.shape[0], n - excluded.shape[1])


class SubsetRule(Rule):
    """The mean of the ``n - f`` rows of least :meth:`score`; needs ``n > 2f`` and at most
    :data:`MAX_SUBSETS` subsets. Subclasses set ``instead`` (the rule to name when the count is
    too large) and ``rtol`` (the scores' tie slack)."""

    instead: str
    rtol: float = 0.0

    def score(self, dist: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
        """``(B,)`` float64 scores of the subsets that exclude the rows of ``excluded`` ``(B, f)``,
        from the rows' squared distances ``dist`` (float64 ``(n, n)``)."""
        raise NotImplementedError

    def check_n(self, n: int) -> None:
        self._require(n > 2 * self.f, "> 2f", n)
        check_count(self.name, n, self.f, self.instead)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        n, f = X.shape[0], self.f
        dist = sq_distances(X)
        keep = best_kept(n, f, lambda excluded: self.score(dist, excluded), X.device, self.rtol)
        self.last_kept = keep
        return weighted_sum(X, keep.to(torch.float64)) / (n - f)
