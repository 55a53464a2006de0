"""Metrics of a benchmark run: how detectable an attack is, and how much damage it does.

Detection (per round, from ``nodes.engine.detectors`` scores and the true Byzantine rows):
``roc_auc``, ``tpr_at_fpr`` and their summary over a run, ``summarize_detection``.
Damage: ``kappa_hat`` (the empirical robustness coefficient of one aggregate) against
``kappa_bound`` (the best any rule can do), and ``leaves_band`` (the first round at which
validation accuracy leaves the band of clean runs).
"""

from __future__ import annotations

import math

import torch

from nodes.engine.names import TO_MEDIAN
from robust.source import BLOCK

F64 = torch.float64


def roc_auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve by the Mann-Whitney U statistic.

    ``AUC = (#{(p, q): s_p > s_q} + 1/2 #{(p, q): s_p = s_q}) / (n_pos n_neg)`` over positive
    rows ``p`` and negative rows ``q``; ``nan`` if there are no positives or no negatives.
    """
    _check(scores, positive)
    return _auc_rows(scores[None], positive)[0]


def tpr_at_fpr(scores: torch.Tensor, positive: torch.Tensor, fpr: float = 0.05) -> float:
    """True-positive rate of the rule "flag ``score > t``" at false-positive rate ``<= fpr``.

    ``t`` is the lowest threshold that flags at most ``k = floor(fpr * n_neg)`` negatives: the
    ``(k+1)``-th largest negative score (``-inf`` when ``k >= n_neg``). Negatives tied with
    ``t`` are not flagged, so ties never let more than ``fpr`` of the negatives through (nor
    the positives tied with them). ``nan`` if there are no positives or no negatives.
    """
    if not 0.0 <= fpr <= 1.0:
        raise ValueError(f"fpr must be in [0, 1] (got {fpr})")
    _check(scores, positive)
    return _tpr_rows(scores[None], positive, fpr)[0]


def summarize_detection(
    rounds: list[dict[str, torch.Tensor]], positive: list[torch.Tensor]
) -> dict[str, dict]:
    """Per detector: ``{"auc", "tpr_at_5fpr", "rounds_to_detect"}`` over a run's rounds.

    ``rounds[r]`` maps detector names to round ``r``'s scores (``to-median``, a plain distance
    the flag policy reads, is no detector and is left out), ``positive[r]`` marks its
    Byzantine rows. ``auc`` and ``tpr_at_5fpr`` are means over the rounds where they are
    defined (a round without positives, negatives or that detector is skipped; ``nan`` if
    none is left). ``rounds_to_detect`` is the first round ``r`` with ``tpr_at_fpr == 1`` such
    that every later defined round also has ``tpr_at_fpr == 1``; ``None`` if there is none.
    Rounds with the same Byzantine rows are scored together, one stacked tensor per detector.
    """
    if len(rounds) != len(positive):
        raise ValueError(
            f"rounds and positive must have one entry per round (got {len(rounds)} and {len(positive)})"
        )
    names = list(dict.fromkeys(name for scores in rounds for name in scores if name != TO_MEDIAN))
    masks = [tuple(pos.tolist()) for pos in positive]
    summary: dict[str, dict] = {}
    for name in names:
        aucs, tprs = [math.nan] * len(rounds), [math.nan] * len(rounds)
        groups: dict[tuple, list[int]] = {}
        for r, scores in enumerate(rounds):
            if name in scores:
                _check(scores[name], positive[r])
                groups.setdefault(masks[r], []).append(r)
        for members in groups.values():
            stacked, pos = torch.stack([rounds[r][name] for r in members]), positive[members[0]]
            for r, auc, tpr in zip(members, _auc_rows(stacked, pos), _tpr_rows(stacked, pos, 0.05)):
                aucs[r], tprs[r] = auc, tpr
        summary[name] = {
            "auc": _nanmean(aucs),
            "tpr_at_5fpr": _nanmean(tprs),
            "rounds_to_detect": _rounds_to_detect(tprs),
        }
    return summary


def _auc_rows(scores: torch.Tensor, positive: torch.Tensor) -> list[float]:
    """:func:`roc_auc` of every row of ``scores`` (``(R, n)``) against one mask ``positive``."""
    pos, neg = scores[:, positive].to(F64), scores[:, ~positive].to(F64)
    if pos.shape[1] == 0 or neg.shape[1] == 0:
        return [math.nan] * scores.shape[0]
    greater = (pos[:, :, None] > neg[:, None, :]).sum(dim=(1, 2)).tolist()
    ties = (pos[:, :, None] == neg[:, None, :]).sum(dim=(1, 2)).tolist()
    pairs = pos.shape[1] * neg.shape[1]
    return [(g + 0.5 * t) / pairs for g, t in zip(greater, ties)]  # exact counts, float64 ratio


def _tpr_rows(scores: torch.Tensor, positive: torch.Tensor, fpr: float) -> list[float]:
    """:func:`tpr_at_fpr` of every row of ``scores`` (``(R, n)``) against one mask ``positive``."""
    pos, neg = scores[:, positive].to(F64), scores[:, ~positive].to(F64)
    if pos.shape[1] == 0 or neg.shape[1] == 0:
        return [math.nan] * scores.shape[0]
    k = math.floor(fpr * neg.shape[1] + 1e-9)  # 0.29 * 100 = 28.999...: allow 29
    if k >= neg.shape[1]:
        return [1.0] * scores.shape[0]
    t = torch.sort(neg, dim=1, descending=True).values[:, k : k + 1]
    return (pos > t).to(F64).mean(dim=1).tolist()


def kappa_hat(aggregate: torch.Tensor, honest: torch.Tensor) -> float:
    """Empirical robustness coefficient ``||F(X) - mean(H)||^2 / (1/m sum_i ||h_i - mean(H)||^2)``.

    ``honest`` is the ``(m, d)`` matrix ``H`` of honest rows, ``aggregate`` the ``(d,)`` output
    ``F(X)``. Float64, accumulated over column blocks (no float64 copy of ``H``). ``inf`` if
    the honest rows coincide and the aggregate differs from them, ``0`` if both terms are 0.
    """
    if honest.dim() != 2 or honest.shape[0] < 1 or tuple(aggregate.shape) != (honest.shape[1],):
        raise ValueError(
            f"need honest of shape (m, d) with m >= 1 and aggregate of shape (d,) "
            f"(got {tuple(honest.shape)} and {tuple(aggregate.shape)})"
        )
    err = torch.zeros((), dtype=F64)
    spread = torch.zeros((), dtype=F64)
    for s in range(0, honest.shape[1], BLOCK):
        block = honest[:, s : s + BLOCK].to(F64, copy=True)
        mean = block.mean(dim=0)
        gap = aggregate[s : s + BLOCK].to(F64) - mean
        block -= mean
        err += gap @ gap  # dot products: no squared temporaries
        spread += block.reshape(-1) @ block.reshape(-1)
    spread /= honest.shape[0]
    if spread == 0:
        return 0.0 if err == 0 else math.inf
    return float(err / spread)


def kappa_bound(n: int, f: int) -> float:
    """Lower bound ``f / (n - 2f)`` on the kappa any rule can guarantee (Allouah et al., 2023)."""
    if f < 0 or n <= 2 * f:
        raise ValueError(
            f"kappa bound needs f >= 0 and n > 2f (got n={n}, f={f}): lower f or add nodes"
        )
    return f / (n - 2 * f)


def leaves_band(attacked: list[float], clean: list[list[float]]) -> int | None:
    """First round ``r`` with ``attacked[r]`` outside ``[min_c clean[c][r], max_c clean[c][r]]``.

    ``clean`` holds the accuracies of the same scenario without the attack (several seeds).
    Only the rounds every list has are compared; ``None`` if the attacked run never leaves the
    band there.
    """
    if not clean:
        raise ValueError("leaves_band needs at least one clean run to form the band")
    rounds = min(len(attacked), *(len(run) for run in clean))
    if rounds == 0:
        return None
    band = torch.tensor([run[:rounds] for run in clean], dtype=F64)
    acc = torch.tensor(attacked[:rounds], dtype=F64)
    outside = ((acc < band.min(dim=0).values) | (acc > band.max(dim=0).values)).nonzero()
    return int(outside[0, 0]) if outside.numel() else None


def _check(scores: torch.Tensor, positive: torch.Tensor) -> None:
    if positive.dtype != torch.bool or positive.shape != scores.shape or scores.dim() != 1:
        raise ValueError(
            f"need 1-D scores and a bool positive mask of the same shape "
            f"(got {tuple(scores.shape)} and {positive.dtype} {tuple(positive.shape)})"
        )


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _rounds_to_detect(tprs: list[float]) -> int | None:
    """First round with TPR 1 after which no defined round has TPR below 1."""
    first = None
    for r, tpr in enumerate(tprs):
        if math.isnan(tpr):
            continue
        if tpr < 1.0:
            first = None
        elif first is None:
            first = r
    return first
