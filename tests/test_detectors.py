"""Detectors (``nodes.engine.detectors``) and detection/damage metrics (``evaluation.reports.metrics``).

Hand-computed examples carry their arithmetic in comments; detector values are checked
against direct float64 formulas (SVD, cosine similarity, brute-force distances), not against
the implementation's own shortcuts.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aggregators
from aggregators._columns import median_of_sorted, reduce_sorted_columns
from aggregators.krum import krum_scores
from nodes.engine.detectors import DETECTORS, measure, score_round
from nodes.engine.names import TO_MEDIAN
from nodes.engine.engine import assess
from robust.geometry import row_norms, sq_distances
from robust.source import BLOCK, Memory
from evaluation.reports.metrics import (
    kappa_bound,
    kappa_hat,
    leaves_band,
    roc_auc,
    summarize_detection,
    tpr_at_fpr,
)

F64 = torch.float64
SCORED = [name for name in DETECTORS if name not in ("discarded", "loss-score")]  # what the rows alone give


def T(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def B(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


def honest_and_byzantine(seed: int, n_honest: int = 20, n_byz: int = 4, d: int = 50):
    """Honest rows ~ N(1, I); Byzantine rows are a placeholder filled in by the caller."""
    g = torch.Generator().manual_seed(seed)
    X = 1.0 + torch.randn(n_honest + n_byz, d, generator=g)
    positive = torch.zeros(n_honest + n_byz, dtype=torch.bool)
    positive[n_honest:] = True
    return X, positive


# ------------------------------------------------------------------ roc_auc


def test_auc_hand_examples():
    # pos {0.35, 0.8} vs neg {0.1, 0.4}: 0.35>0.1, 0.8>0.1, 0.8>0.4 -> 3/4
    assert roc_auc(T([0.1, 0.4, 0.35, 0.8]), B([0, 0, 1, 1])) == 0.75
    # pos {2, 3} vs neg {1, 2}: 2>1, 2=2 (1/2), 3>1, 3>2 -> 3.5/4
    assert roc_auc(T([1, 2, 2, 3]), B([0, 1, 0, 1])) == 0.875
    assert roc_auc(T([5, 5, 5]), B([1, 0, 0])) == 0.5  # all tied
    assert roc_auc(T([3, 2, 1]), B([0, 1, 1])) == 0.0
    assert math.isnan(roc_auc(T([1, 2]), B([0, 0])))
    assert math.isnan(roc_auc(T([1, 2]), B([1, 1])))


def test_metrics_reject_mismatched_masks():
    with pytest.raises(ValueError, match="bool positive mask"):
        roc_auc(T([1, 2, 3]), B([0, 1]))
    with pytest.raises(ValueError, match="bool positive mask"):
        tpr_at_fpr(T([1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="fpr must be in"):
        tpr_at_fpr(T([1, 2]), B([0, 1]), fpr=1.5)


scores_and_mask = st.integers(2, 30).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(-5, 5), min_size=n, max_size=n),  # small range: many ties
        st.lists(st.booleans(), min_size=n, max_size=n),
    )
)


@settings(max_examples=200, deadline=None)
@given(scores_and_mask)
def test_auc_symmetry_and_invariance(data):
    scores, mask = T(data[0]), B(data[1])
    auc = roc_auc(scores, mask)
    if mask.all() or not mask.any():
        assert math.isnan(auc)
        return
    assert 0.0 <= auc <= 1.0
    assert roc_auc(-scores, mask) == pytest.approx(1.0 - auc)
    assert roc_auc(-scores, ~mask) == pytest.approx(auc)  # swap both the roles and the order
    assert roc_auc(torch.exp(scores), mask) == auc  # only the order matters


# ------------------------------------------------------------------ tpr_at_fpr


def test_tpr_hand_example():
    neg = list(range(20))  # 0..19, fpr 0.05 -> at most 1 negative flagged -> t = 18
    scores = T(neg + [17.5, 18, 18.5, 25])
    mask = B([0] * 20 + [1] * 4)
    assert tpr_at_fpr(scores, mask) == 0.5  # 18.5 and 25 are > 18; 18 itself is not
    assert tpr_at_fpr(scores, mask, fpr=0.0) == 0.25  # t = 19: only 25
    assert tpr_at_fpr(scores, mask, fpr=1.0) == 1.0
    assert math.isnan(tpr_at_fpr(scores, torch.zeros(24, dtype=torch.bool)))


def test_tpr_ties_never_exceed_fpr():
    # 18 negatives at 0, 2 at 5; fpr 0.05 allows 1 negative: flagging score 5 would let 2
    # (10 %) through, so t = 5 and only the positive at 6 is flagged.
    scores = T([0] * 18 + [5, 5] + [5, 6])
    mask = B([0] * 20 + [1, 1])
    assert tpr_at_fpr(scores, mask, fpr=0.05) == 0.5
    assert tpr_at_fpr(scores, mask, fpr=0.10) == 1.0  # 2 of 20 allowed: t = 0


@settings(max_examples=200, deadline=None)
@given(scores_and_mask, st.sampled_from([0.0, 0.05, 0.1, 0.29, 0.5, 1.0]))
def test_tpr_is_the_best_threshold_within_fpr(data, fpr):
    scores, mask = T(data[0]), B(data[1])
    tpr = tpr_at_fpr(scores, mask, fpr)
    if mask.all() or not mask.any():
        assert math.isnan(tpr)
        return
    pos, neg = scores[mask], scores[~mask]
    best = 0.0  # brute force over every threshold that matters
    for t in [-math.inf] + scores.tolist():
        if (neg > t).double().mean() <= fpr + 1e-12:
            best = max(best, float((pos > t).double().mean()))
    assert tpr == best


# ------------------------------------------------------------------ score_round


def test_keys_shapes_dtypes():
    X = torch.randn(7, 5)  # float32 in, float64 out
    scores = score_round(X, f=1)
    assert tuple(scores) == (*SCORED, TO_MEDIAN)
    for s in scores.values():
        assert s.dtype == F64 and s.shape == (7,) and torch.isfinite(s).all()
    kept = B([1, 1, 0, 1, 0, 1, 1])
    effects = torch.linspace(-1, 1, 7, dtype=F64)
    scores = score_round(X, f=1, kept=kept, effects=effects)
    assert tuple(scores) == (*DETECTORS, TO_MEDIAN)
    assert scores["discarded"].tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert torch.equal(scores["loss-score"], effects)


def test_bad_arguments():
    with pytest.raises(ValueError, match="kept must be a bool tensor of shape \\(3,\\)"):
        score_round(torch.randn(3, 2), f=0, kept=B([1, 0]))
    with pytest.raises(ValueError, match="f must be a whole number"):
        score_round(torch.randn(3, 2), f=-1)
    with pytest.raises(ValueError, match="NaN or Inf"):
        score_round(T([[0.0, math.nan], [1.0, 1.0]]), f=0)


def test_zero_rows_give_no_nan():
    X = T([[0, 0, 0], [1, 2, 3], [1, 2, 2], [2, 2, 3]])
    scores = score_round(X, f=0)
    assert all(torch.isfinite(s).all() for s in scores.values())
    # norms 0, 3.74, 3, 4.12 (lower median 3): the zero row deviates by 3
    assert float(scores["norm"][0]) == pytest.approx(3.0)
    zero = score_round(torch.zeros(4, 3), f=1)  # median is zero too: every statistic is equal
    for s in zero.values():
        assert torch.equal(s, torch.zeros(4, dtype=F64))


def test_values_match_direct_formulas():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(9, 13, generator=g, dtype=F64) + 3.0
    s = score_round(X, f=2)
    med = X.median(dim=0).values  # n odd: the same median as the even-n convention

    def dev(stat):  # scores are two-sided: distance to the round's median statistic
        return (stat - stat.median()).abs()

    assert torch.allclose(s["norm"], dev(X.norm(dim=1)))
    assert torch.allclose(s["median-distance"], dev((X - med).norm(dim=1)))
    to_median = (X - med).norm(dim=1)
    assert torch.allclose(s["distance-ratio"], to_median / to_median.median())
    cos = torch.nn.functional.cosine_similarity(X, med[None], dim=1)
    assert torch.allclose(s["median-cosine"], dev(1 - cos))
    brute = ((X[:, None] - X[None]) ** 2).sum(-1)
    assert torch.allclose(s["krum-score"], dev(krum_scores(brute, 2)))
    C = X - X.mean(dim=0)
    v = torch.linalg.svd(C).Vh[0]
    assert torch.allclose(s["spectral"], (C @ v).abs())


def test_distance_ratio_is_scale_free_and_survives_a_zero_median():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(8, 20, generator=g, dtype=F64)
    assert torch.allclose(score_round(1e-3 * X, f=1)["distance-ratio"], score_round(X, f=1)["distance-ratio"])
    same = torch.ones(5, 4, dtype=F64)
    same[4] = 3.0  # four identical rows and one apart: the typical distance is 0
    assert score_round(same, f=1)["distance-ratio"].tolist() == [0, 0, 0, 0, float("inf")]


def test_krum_score_clamps_neighbours_for_small_n():
    X = T([[0.0], [1.0], [3.0]])  # squared distances: 0-1: 1, 0-3: 9, 1-3: 4
    # n=3, f=1: n-f-2 = 0 neighbours, clamped to 1 -> nearest squared distance 1, 1, 4;
    # two-sided around their median 1
    assert score_round(X, f=1)["krum-score"].tolist() == [0.0, 0.0, 3.0]
    assert score_round(X[:2], f=5)["krum-score"].tolist() == [0.0, 0.0]
    assert score_round(X[:1], f=0)["krum-score"].tolist() == [0.0]  # no other row


def test_spectral_is_deterministic_and_permutation_equivariant():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(30, 200, generator=g)
    a = score_round(X, f=3)["spectral"]
    assert torch.equal(a, score_round(X.clone(), f=3)["spectral"])
    perm = torch.randperm(30, generator=g)
    assert torch.allclose(score_round(X[perm], f=3)["spectral"], a[perm])


@pytest.mark.parametrize("seed", range(5))
def test_every_detector_catches_a_scaled_sign_flip(seed):
    X, positive = honest_and_byzantine(seed)
    X[positive] = -20.0  # -20 * the honest mean direction: large, opposite, colluding
    scores = score_round(X, f=4, kept=~positive)
    for name in SCORED:
        assert roc_auc(scores[name], positive) == 1.0, name
        assert tpr_at_fpr(scores[name], positive) == 1.0, name


def test_detectors_are_blind_when_byzantine_rows_look_honest():
    rounds = [honest_and_byzantine(seed) for seed in range(100)]
    summary = summarize_detection([score_round(X, f=4) for X, _ in rounds], [p for _, p in rounds])
    assert set(summary) == set(SCORED)
    for name, stats in summary.items():
        assert abs(stats["auc"] - 0.5) < 0.15, (name, stats)


# ------------------------------------------------------------------ summarize_detection


def test_summarize_detection_hand_sequence():
    pos = B([0, 0, 0, 1])  # 3 negatives: fpr 5 % allows none, so t = the top negative
    norm = [T([0, 1, 2, 3]), T([0, 1, 3, 2]), T([0, 1, 2, 5]), T([0, 0, 0, 1])]
    # TPR 1, 0, 1, 1; AUC 1, 2/3, 1, 1
    spectral = [T([0, 1, 2, 3]), T([0, 1, 2, 3]), T([0, 1, 2, 3]), T([3, 1, 2, 0])]
    # TPR 1, 1, 1, 0: the last round breaks the streak
    rounds = [{"norm": a, "spectral": b} for a, b in zip(norm, spectral)]
    rounds.append({"norm": T([0, 1, 2, 3]), "spectral": T([0, 1, 2, 3])})
    positive = [pos] * 4 + [B([0, 0, 0, 0])]  # round 4 has no Byzantine row: skipped
    summary = summarize_detection(rounds, positive)
    assert summary["norm"]["auc"] == pytest.approx((1 + 2 / 3 + 1 + 1) / 4)
    assert summary["norm"]["tpr_at_5fpr"] == 0.75
    assert summary["norm"]["rounds_to_detect"] == 2
    assert summary["spectral"]["auc"] == pytest.approx(3 / 4)
    assert summary["spectral"]["rounds_to_detect"] is None
    with pytest.raises(ValueError, match="one entry per round"):
        summarize_detection(rounds, positive[:2])


# ------------------------------------------------------------------ kappa


def test_kappa_hat_hand_values():
    H = T([[1, 0], [-1, 0]])  # mean 0, mean squared distance to it: (1 + 1) / 2 = 1 = sigma^2
    assert kappa_hat(T([2, 0]), H) == 4.0  # distance 2 sigma -> (2 sigma)^2 / sigma^2
    assert kappa_hat(T([0, 0]), H) == 0.0
    same = T([[1, 1], [1, 1]])
    assert kappa_hat(T([1, 1]), same) == 0.0
    assert kappa_hat(T([0, 1]), same) == math.inf
    with pytest.raises(ValueError, match="aggregate of shape"):
        kappa_hat(T([0, 0, 0]), H)


def test_kappa_hat_mean_of_honest_is_zero_and_blocks_add_up():
    g = torch.Generator().manual_seed(2)
    H = torch.randn(6, 10_000, generator=g)  # more columns than one block
    assert kappa_hat(H.double().mean(dim=0), H) < 1e-20
    mean = H.double().mean(dim=0)
    sigma2 = (H.double() - mean).square().sum() / 6
    shifted = mean.clone()
    shifted[-1] += 2 * sigma2.sqrt()  # 2 sigma away, in the last block
    assert kappa_hat(shifted, H) == pytest.approx(4.0, rel=1e-12)


def test_kappa_bound():
    assert kappa_bound(10, 2) == pytest.approx(1 / 3)  # 2 / (10 - 4)
    assert kappa_bound(5, 0) == 0.0
    with pytest.raises(ValueError, match=r"n > 2f \(got n=4, f=2\)"):
        kappa_bound(4, 2)


# ------------------------------------------------------------------ leaves_band


def test_leaves_band():
    clean = [[0.10, 0.20, 0.30], [0.15, 0.25, 0.35]]
    assert leaves_band([0.12, 0.20, 0.10], clean) == 2  # 0.20 is on the band's edge: inside
    assert leaves_band([0.20, 0.20, 0.30], clean) == 0  # above 0.15
    assert leaves_band([0.10, 0.25, 0.30, 0.0], clean) is None  # round 3 is beyond the band
    assert leaves_band([0.10, 0.25, 0.0], [[0.1, 0.2, 0.3], [0.1, 0.3]]) is None  # 2 rounds
    assert leaves_band([], clean) is None
    with pytest.raises(ValueError, match="at least one clean run"):
        leaves_band([0.1], [])


def test_suspiciously_typical_rows_are_caught():
    """ALIE-like collusion: identical rows at the centre, closer to everything than honest rows."""
    X, positive = honest_and_byzantine(0)
    X[positive] = X[~positive].mean(dim=0)
    scores = score_round(X, f=4)
    assert roc_auc(scores["krum-score"], positive) == 1.0
    assert roc_auc(scores["median-distance"], positive) == 1.0


# ------------------------------------------------------------------ one pass, shared with the rule


class Counted(Memory):
    """Rows in memory that count how often they are read (as blocks, or as views)."""

    reads = 0

    def blocks(self):
        self.reads += 1
        yield from super().blocks()

    def views(self):
        self.reads += 1
        yield from super().views()


def separate(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The median, distances, norms and distances to the median, each by its own function."""
    med = reduce_sorted_columns(X, median_of_sorted).to(F64)
    return med, sq_distances(X), row_norms(X), row_norms(X, center=med)


@pytest.mark.parametrize("n, d", [(25, BLOCK + 1546), (6, 1), (1, 7), (4, 3)])
def test_one_pass_gives_each_statistics_own_bits_and_leaves_the_rows(n, d):
    g = torch.Generator().manual_seed(n + d)
    X = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) + torch.randn(d, generator=g)
    X[:, 0] = torch.tensor([0.0, -0.0] * n)[:n]  # signed zeros: the median is +0.0 whatever the order
    before = X.clone()
    rows = Counted(X, validated=True)
    med, dist, (norms, to_median, _) = measure(rows)
    assert rows.reads == 1  # every detector's statistic from one read of the rows
    for got, want in zip((med, dist, norms, to_median), separate(X)):
        assert got.dtype == want.dtype and got.numpy().tobytes() == want.numpy().tobytes()
    assert X.numpy().tobytes() == before.numpy().tobytes()  # a block of one row or column sorted as a copy


@pytest.mark.parametrize("spec, reads", [("median", 2), ("trimmed-mean", 2), ("krum", 2), ("mean", 2)])
def test_the_round_reads_its_rows_once_per_rule_and_once_for_the_detectors(spec, reads):
    """A coordinate-wise rule leaves its median and Krum its distances with the rows: the
    detectors reuse them, with the bits they would compute alone."""
    g = torch.Generator().manual_seed(7)
    X = torch.randn(11, 300, generator=g)
    rows = Counted(X, validated=True)  # as the engine hands them over: known finite, not checked again
    aggregate, scores = assess(aggregators.build(spec, 2), rows, True)
    assert rows.reads == reads
    alone = score_round(X, 2)
    for name, s in alone.items():
        assert scores[name].numpy().tobytes() == s.numpy().tobytes(), name
    assert aggregate.numpy().tobytes() == aggregators.build(spec, 2)(X).numpy().tobytes()
