"""Per-round suspicion scores: how suspicious each row of a round's update matrix looks.

The round engine (``nodes.engine.engine``) scores every round with :func:`score_round`: the flag
policy (``nodes.engine.flags``) reads :data:`~nodes.engine.names.TO_MEDIAN`, the benchmark measures every detector's
AUC against the true Byzantine rows.

``score_round(X, f, kept)`` returns one float64 ``(n,)`` tensor per detector, rows in the
canonical order of ``X``; higher means more suspicious; and :data:`~nodes.engine.names.TO_MEDIAN`, each row's
plain distance ``||x_i - m||`` (not a detector: within a round it ranks the rows as
``distance-ratio`` does), which the flag policy divides by a typical distance it keeps over
the run. All detectors share one exact
float64 squared-distance matrix ``D`` (``robust.geometry.sq_distances``) and one
coordinate-wise median ``m``, computed with the norms in one pass over the rows' blocks
(:func:`measure`), or taken from the rows' memo where the round's rule computed them (a
coordinate-wise rule's median, Krum's or NNM's distances); memory beyond ``X`` is
O(n^2 + n * BLOCK + d).

- ``norm``: ``||x_i||``. Catches scaled or boosted updates (sign-flip with a large factor,
  gaussian noise, model replacement).
- ``median-distance``: ``||x_i - m||``. Catches rows far from the bulk even when their norm is
  ordinary (a large shift of a coordinate group, a Fang-style reversed update).
- ``distance-ratio``: ``||x_i - m|| / median_j ||x_j - m||``, one-sided and scale-free: a
  row twice as far from the median as the typical row scores 2 whatever the update's size
  (``inf`` if the typical distance is 0 and this one is not; 0 if both are). The
  coordinator's flag policy divides by the run's typical distance instead of the round's.
- ``median-cosine``: ``1 - cos(x_i, m)``, the cosine taken as 0 when ``x_i`` or ``m`` is the
  zero vector (score 1, never NaN). Catches direction attacks whose norm is disguised
  (sign-flip, IPM with a large epsilon).
- ``krum-score``: Krum's score ``sum_{j in N_i} ||x_i - x_j||^2`` over the
  ``k = n - f - 2`` nearest other rows, clamped to ``1 <= k <= n - 1`` (``k = 0``, score 0,
  only when ``n = 1``) so that small rounds still get a score. Catches isolated rows; misses
  rows that hide inside the honest cloud (ALIE, mimic).
- ``spectral``: ``|<x_i - mu, v>|`` with ``mu`` the row mean and ``v`` the top right-singular
  vector of the centred matrix ``C``. Catches colluding rows that all push one direction
  (ALIE, IPM, min-max), which dominate the top principal direction even when each row looks
  plausible on its own.
- Every score but ``distance-ratio``, ``spectral``, ``loss-score`` and ``discarded`` is two-sided, ``|s_i - median_j s_j|`` of
  the statistic above: a Byzantine row can be suspiciously *typical* (ALIE and mimic rows sit
  closer to the centre and to each other than honest rows do; a sign-flipped mean is shorter
  than any honest row), and a one-sided score would rank it least suspicious.
- ``loss-score``: ``L_root(step(w, x_i / n)) - L_root(w)``, what the row alone, at its share of the mean, does to the loss of
  the coordinator's root samples (``nodes.engine.loss_ratings``; only where it holds a root set,
  ``root = N``). One-sided: a row that raises the held-out loss, or lowers it less than the
  others, is suspicious whatever its geometry.
- ``discarded``: 1 where the aggregator did not keep the row, else 0 (only when ``kept`` is
  given). Measures what the defence itself flagged (Krum, Multi-Krum, Bulyan selections).
"""

from __future__ import annotations

import torch

from aggregators._columns import MEDIAN, median_of_sorted, sorted_columns
from aggregators.base import check_updates
from aggregators.krum import krum_scores
from robust.geometry import MEMO as SQ_DISTANCES, add_gram, distances, row_norms
from robust.source import Rows, as_rows

from .names import TO_MEDIAN

DETECTORS: tuple[str, ...] = (
    "norm",
    "median-distance",
    "distance-ratio",
    "median-cosine",
    "krum-score",
    "spectral",
    "loss-score",
    "discarded",
)

F64 = torch.float64


def score_round(
    X: torch.Tensor | Rows, f: int, kept: torch.Tensor | None = None, effects: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Suspicion scores of every row of ``X`` (float ``(n, d)``), keyed by detector name,
    then :data:`~nodes.engine.names.TO_MEDIAN`.

    ``f`` is the number of Byzantine rows Krum assumes; ``kept`` (bool ``(n,)``) says which
    rows the aggregator kept and adds the ``discarded`` detector; ``effects`` (float64 ``(n,)``,
    ``nodes.engine.loss_ratings``) each row's effect on the held-out loss, the ``loss-score``.
    Raises ``ValueError`` on a malformed ``X``, ``f``, ``kept`` or ``effects``.
    """
    check_updates(X)
    X = as_rows(X)
    n = X.n
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ValueError(f"f must be a whole number >= 0 (got {f!r})")
    if kept is not None and (kept.dtype != torch.bool or tuple(kept.shape) != (n,)):
        raise ValueError(
            f"kept must be a bool tensor of shape ({n},) (got {kept.dtype}, {tuple(kept.shape)})"
        )
    if effects is not None and (effects.dtype != F64 or tuple(effects.shape) != (n,)):
        raise ValueError(f"effects must be a float64 tensor of shape ({n},) (got {effects.dtype}, {tuple(effects.shape)})")
    med, dist, (norms, to_median, dots) = measure(X)
    scores = {
        "norm": two_sided(norms),
        "median-distance": two_sided(to_median),
        "distance-ratio": ratio_to_median(to_median),
        "median-cosine": two_sided(median_cosine(dots, med, norms)),
        "krum-score": two_sided(krum_score(dist, f)),
        "spectral": spectral(dist),
    }
    if effects is not None:
        scores["loss-score"] = effects.to(X.device)
    if kept is not None:
        scores["discarded"] = (~kept).to(F64)
    scores[TO_MEDIAN] = to_median
    return scores


def two_sided(statistic: torch.Tensor) -> torch.Tensor:
    """``|s_i - median(s)|``: atypical in either direction is suspicious."""
    return (statistic - statistic.median()).abs()


def ratio_to_median(distance: torch.Tensor) -> torch.Tensor:
    """``d_i / median(d)``; where the median is 0, ``inf`` for ``d_i > 0`` and 0 for ``d_i = 0``."""
    typical = distance.median()
    if typical > 0:
        return distance / typical
    return torch.where(distance > 0, torch.inf, 0.0).to(distance.dtype)


def measure(X: Rows) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """What every detector reads, from one pass over the blocks: the coordinate-wise median
    ``m`` (float64 of the rows' dtype's values), the exact squared distances ``D``
    (``robust.geometry.sq_distances``) and, in float64, ``(||x_i||, ||x_i - m||, <x_i, m>)``.
    ``m`` and ``D`` come from the rows' memo where the round's rule left them; each is the
    same bits as its own function gives (the blocks' arithmetic is theirs). A row whose
    float64 squares overflow is measured again by ``robust.geometry.row_norms``' rescaled path."""
    memo = X.memo
    med = memo.get(MEDIAN)
    sort = med is None
    if sort:
        med = torch.empty(X.d, dtype=X.dtype, device=X.device)
    gram = None if SQ_DISTANCES in memo else torch.zeros(X.n, X.n, dtype=F64, device=X.device)
    sq = torch.zeros(X.n, dtype=F64, device=X.device)
    to_med = torch.zeros_like(sq)
    dots = torch.zeros_like(sq)
    for s, block in X.blocks():
        width = block.shape[1]
        if sort:
            med[s : s + width] = median_of_sorted(sorted_columns(block))
            med[s : s + width].add_(0.0)  # -0.0 -> +0.0, as reduce_sorted_columns does
        b, m = block.to(F64), med[s : s + width].to(F64)
        sq += b.square().sum(dim=1)
        dots += b @ m
        to_med += (b - m).square().sum(dim=1)
        if gram is not None:
            add_gram(gram, b)  # last: it centres b in place
    if sort:
        memo[MEDIAN] = med
    if gram is not None:
        memo[SQ_DISTANCES] = distances(gram)
    med = med.to(F64)
    norms, to_median = sq.sqrt(), to_med.sqrt()
    if not (bool(torch.isfinite(norms).all()) and bool(torch.isfinite(to_median).all())):
        norms, to_median = row_norms(X), row_norms(X, center=med)
    return med, memo[SQ_DISTANCES].clone(), (norms, to_median, dots)


def median_cosine(dots: torch.Tensor, med: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``1 - <x_i, m> / (||x_i|| ||m||)`` from the dot products; 1 (cosine 0) where either
    vector is zero."""
    denom = norms * torch.linalg.vector_norm(med)
    cos = torch.where(denom > 0, dots / torch.where(denom > 0, denom, 1.0), 0.0)
    return 1.0 - cos.clamp(-1.0, 1.0)


def krum_score(dist: torch.Tensor, f: int) -> torch.Tensor:
    """Krum score with ``k = clamp(n - f - 2, 1, n - 1)`` neighbours (see module docstring)."""
    n = dist.shape[0]
    k = min(max(n - f - 2, 1), n - 1)
    return krum_scores(dist, n - 2 - k)  # krum_scores takes n - f - 2 neighbours


def spectral(dist: torch.Tensor) -> torch.Tensor:
    """``|<c_i, v>| = sqrt(lambda_max) |u_i|`` from the centred rows' ``(n, n)`` Gram matrix.

    With ``C = U S V^T``, ``C v = s_1 u`` where ``u`` is the top eigenvector of ``G = C C^T``
    and ``s_1^2 = lambda_max``, so ``v`` (a ``d``-vector) is never formed. ``G`` comes from the
    squared distances by double centring, ``G = -1/2 J D J`` with ``J = I - 11^T / n``, so it
    inherits their exact float64 accumulation. ``eigh`` is a deterministic LAPACK call and the
    sign ambiguity of ``u`` vanishes in the absolute value.
    """
    row_mean = dist.mean(dim=1)
    gram = -0.5 * (dist - row_mean[:, None] - row_mean[None, :] + row_mean.mean())
    gram = 0.5 * (gram + gram.T)
    eigvals, eigvecs = torch.linalg.eigh(gram)
    return eigvals[-1].clamp_min(0.0).sqrt() * eigvecs[:, -1].abs()
