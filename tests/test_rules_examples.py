"""Small hand-computed examples for every rule and pre-aggregator (float64).

Every expected value is worked out in the comments next to it; none is produced by calling
another implementation of the same formula (scipy is only used as a brute-force minimiser
for the geometric median, as an independent check of optimality).
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

import aggregators

F64 = torch.float64


def T(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def close(got: torch.Tensor, expected, tol: float = 1e-12) -> None:
    exp = torch.as_tensor(expected, dtype=F64)
    assert got.dtype == F64
    assert got.shape == exp.shape
    assert torch.allclose(got, exp, rtol=tol, atol=tol), (got, exp)


@contextmanager
def time_limit(seconds: float):
    def handler(signum, frame):
        raise TimeoutError(f"did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_registry_lists():
    assert aggregators.rules() == sorted(
        ["mean", "median", "trimmed-mean", "krum", "multi-krum", "geometric-median", "bulyan",
         "centered-clipping", "meamed", "mda", "monna", "smea", "loss-score", "caf", "dnc", "signguard", "flame", "fltrust", "foolsgold",
         "fldetector", "sign-vote"]
    )
    assert aggregators.pre_aggregators() == ["arc", "bucketing", "clip", "nnm"]
    assert aggregators.names() == sorted(aggregators.rules() + aggregators.pre_aggregators())


# ------------------------------------------------------------------ mean


def test_mean():
    # columns: (1+3+5)/3 = 3, (2+4+9)/3 = 5
    close(aggregators.build("mean", 0)(T([[1, 2], [3, 4], [5, 9]])), [3.0, 5.0])


# ------------------------------------------------------------------ median


def test_median_odd_n():
    X = T([[5, -1], [1, 2], [3, 0], [9, 7], [2, 4]])
    # col 0 sorted: 1 2 [3] 5 9 -> 3 ; col 1 sorted: -1 0 [2] 4 7 -> 2
    out = aggregators.build("median", 2)(X)
    assert torch.equal(out, T([3.0, 2.0]))


def test_median_even_n():
    X = T([[4, 0.5], [1, -3], [10, 7], [2, 1]])
    # col 0 sorted: 1 [2 4] 10 -> 3 ; col 1 sorted: -3 [0.5 1] 7 -> 0.75
    out = aggregators.build("median", 1)(X)
    assert torch.equal(out, T([3.0, 0.75]))


def test_median_single_row():
    assert torch.equal(aggregators.build("median", 0)(T([[1.5, -2.0, 7.0]])), T([1.5, -2.0, 7.0]))


# ------------------------------------------------------------------ trimmed mean


def test_trimmed_mean_f1():
    X = T([[10, 2], [-4, 0], [3, 5], [7, 1], [100, 3], [5, 4]])
    # col 0 sorted: -4 | 3 5 7 10 | 100 -> (3+5+7+10)/4 = 6.25
    # col 1 sorted:  0 | 1 2 3 4  | 5   -> (1+2+3+4)/4 = 2.5
    close(aggregators.build("trimmed-mean", 1)(X), [6.25, 2.5])


def test_trimmed_mean_f2():
    X = T([[10, 2], [-4, 0], [3, 5], [7, 1], [100, 3], [5, 4]])
    # col 0 sorted: -4 3 | 5 7 | 10 100 -> 6 ; col 1: 0 1 | 2 3 | 4 5 -> 2.5
    close(aggregators.build("trimmed-mean", 2)(X), [6.0, 2.5])


def test_trimmed_mean_f0_is_mean():
    close(aggregators.build("trimmed-mean", 0)(T([[1], [2], [6]])), [3.0])


# ------------------------------------------------------------------ sign-vote


def test_sign_vote_takes_the_majority_sign_at_the_median_magnitude():
    X = T([[1.0, -2.0, 0.0, 3.0], [2.0, -1.0, 0.0, -1.0], [-8.0, 4.0, 0.0, 2.0]])
    # column 0: +, +, - -> +, |x| median 2; column 1: -, -, + -> -, median 2; zeros -> 0; column 3: + at 2
    close(aggregators.build("sign-vote", 1)(X), [2.0, -2.0, 0.0, 2.0])
    tie = T([[1.0], [-3.0], [2.0], [-2.0]])
    close(aggregators.build("sign-vote", 1)(tie), [0.0])


def test_sign_vote_holds_against_f_flipped_rows():
    honest = torch.randn(1, 50).sign() * torch.rand(7, 50).add(0.5)  # 7 rows agreeing on every sign
    flipped = -10 * honest[:3]
    out = aggregators.build("sign-vote", 3)(torch.cat([honest, flipped]))
    assert torch.equal(out.sign(), honest[0].sign())
    assert bool((out.abs() <= honest.abs().max(dim=0).values).all())


# ------------------------------------------------------------------ meamed


def test_meamed_basic():
    X = T([[1, 30], [100, 0], [3, 41], [2, 10], [4, 20]])
    # f=1, keep n-f = 4 values closest to the median.
    # col 0: values 1 100 3 2 4, median 3, |.-3| = 2 97 0 1 1 -> keep 1,2,3,4 -> 2.5
    # col 1: values 30 0 41 10 20, median 20, |.-20| = 10 20 21 10 0 -> keep 0,10,20,30 -> 15
    close(aggregators.build("meamed", 1)(X), [2.5, 15.0])


def test_meamed_tie_keeps_the_smaller_value():
    # values 5 1 4 2 3 (rows in this order), median 3; |.-3| = 2 2 1 1 0
    # the 4 closest: 2 3 4 and one of {1, 5} (both at distance 2): the smaller, 1, is kept
    # -> (1+2+3+4)/4 = 2.5  (keeping 5 instead would give 3.5)
    X = T([[5], [1], [4], [2], [3]])
    close(aggregators.build("meamed", 1)(X), [2.5])
    # mirrored: -5 -1 -4 -2 -3, median -3; tie between -5 and -1 -> the smaller, -5
    # -> (-5-4-3-2)/4 = -3.5
    close(aggregators.build("meamed", 1)(-X), [-3.5])


def test_meamed_even_n():
    # n=4, f=1: values 0 1 2 10, median 1.5, |.-1.5| = 1.5 .5 .5 8.5 -> keep 0,1,2 -> 1
    close(aggregators.build("meamed", 1)(T([[2], [10], [0], [1]])), [1.0])


def test_meamed_can_leave_the_honest_range():
    # Not a bug, a property of the rule: honest {0, 10}, Byzantine 11 (n=3, f=1).
    # median 10, |.-10| = 10 0 1 -> keep 10 and 11 -> 10.5 > max honest value 10.
    close(aggregators.build("meamed", 1)(T([[0], [10], [11]])), [10.5])


# ------------------------------------------------------------------ krum / multi-krum

# rows (d=2, second coordinate 0): x = 3, 20, 1, 0, 7 ; n=5, f=1 -> n-f-2 = 2 neighbours
#   score(3)  = |3-1|^2 + |3-0|^2   = 4 + 9     = 13
#   score(20) = |20-7|^2 + |20-3|^2 = 169 + 289 = 458
#   score(1)  = |1-0|^2 + |1-3|^2   = 1 + 4     = 5    <- smallest
#   score(0)  = |0-1|^2 + |0-3|^2   = 1 + 9     = 10
#   score(7)  = |7-3|^2 + |7-1|^2   = 16 + 36   = 52
KRUM_X = [[3, 0], [20, 0], [1, 0], [0, 0], [7, 0]]


def test_krum_picks_smallest_score():
    X = T(KRUM_X)
    out = aggregators.build("krum", 1)(X)
    assert torch.equal(out, X[2])


def test_krum_f0_uses_n_minus_2_neighbours():
    # f=0 -> 3 neighbours: score(3) = 4+9+16 = 29, score(1) = 1+4+36 = 41,
    # score(0) = 1+9+49 = 59, score(7) = 16+36+49 = 101 -> row 0 (x=3)
    X = T(KRUM_X)
    assert torch.equal(aggregators.build("krum", 0)(X), X[0])


@pytest.mark.parametrize("order, expected_row", [([10, -1, 1, -10, 30], 1), ([10, 1, -1, -10, 30], 1)])
def test_krum_tie_goes_to_lowest_index(order, expected_row):
    # n=5, f=1, 2 neighbours:
    #   score(-1) = |-1-1|^2 + |-1+10|^2 = 4 + 81 = 85
    #   score( 1) = |1+1|^2  + |1-10|^2  = 4 + 81 = 85   (tie with -1)
    #   score(10) = 81 + 121 = 202, score(-10) = 81 + 121 = 202, score(30) = 400 + 841
    # the tie between rows 1 and 2 goes to row 1, whichever value it holds
    X = T([[v] for v in order])
    out = aggregators.build("krum", 1)(X)
    assert torch.equal(out, X[expected_row])


def test_multi_krum_default_m_is_n_minus_f():
    # scores from KRUM_X: 1 -> 5, 0 -> 10, 3 -> 13, 7 -> 52, 20 -> 458
    # m = n - f = 4: rows 1, 0, 3, 7 -> mean (1+0+3+7)/4 = 2.75
    close(aggregators.build("multi-krum", 1)(T(KRUM_X)), [2.75, 0.0])


@pytest.mark.parametrize("m, expected", [(1, 1.0), (2, 0.5), (3, 4 / 3), (5, 31 / 5)])
def test_multi_krum_explicit_m(m, expected):
    # m=1: {1} -> 1 ; m=2: {1,0} -> 0.5 ; m=3: {1,0,3} -> 4/3 ; m=5: all -> 31/5
    close(aggregators.build(f"multi-krum:m={m}", 1)(T(KRUM_X)), [expected, 0.0])


def test_multi_krum_m1_equals_krum():
    X = T(KRUM_X)
    assert torch.equal(aggregators.build("multi-krum:m=1", 1)(X), aggregators.build("krum", 1)(X))


# ------------------------------------------------------------------ bulyan


def test_bulyan_n7_f1():
    # x = 0 1 3 6 10 100 -100 (rows 0..6), n=7=4f+3, f=1: theta = 5 Krum rounds, beta = 3.
    # Krum with f=1 on r candidates sums the r-3 smallest squared distances.
    # round 1 (r=7, 4 nbrs): s(0)=1+9+36+100=146, s(1)=1+4+25+81=111, s(3)=4+9+9+49=71,
    #   s(6)=9+16+25+36=86, s(10)=16+49+81+100=246, s(+-100) huge      -> pick 3
    # round 2 (r=6, 3 nbrs): s(0)=1+36+100=137, s(1)=1+25+81=107, s(6)=16+25+36=77,
    #   s(10)=16+81+100=197                                               -> pick 6
    # round 3 (r=5, 2 nbrs): s(0)=1+100=101, s(1)=1+81=82, s(10)=81+100=181 -> pick 1
    # round 4 (r=4, 1 nbr):  s(0)=100, s(10)=100 (tie -> lower row, 0), s(100)=8100 -> pick 0
    # round 5 (r=3, 0 nbrs): all scores 0 -> lowest row: 10                 -> pick 10
    # selected {0,1,3,6,10}; median 3; |.-3| = 3 2 0 3 7; beta=3 closest: 1, 3 and the
    # tie {0, 6} -> the smaller, 0 -> (0+1+3)/3 = 4/3
    X = T([[0], [1], [3], [6], [10], [100], [-100]])
    close(aggregators.build("bulyan", 1)(X), [4 / 3])


def test_bulyan_f0_is_mean_of_all_rows():
    # f=0: theta = n, beta = n -> every row selected and kept: plain mean
    close(aggregators.build("bulyan", 0)(T([[1, 2], [3, 5], [8, -1]])), [4.0, 2.0])


# ------------------------------------------------------------------ geometric median


def _sum_dist(z, P):
    return float(np.linalg.norm(P - z, axis=1).sum())


def _brute_force_min(P: np.ndarray) -> float:
    starts = [P.mean(0), np.median(P, 0), *P]
    best = min(
        (minimize(_sum_dist, x0, args=(P,), method="Nelder-Mead",
                  options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000}) for x0 in starts),
        key=lambda r: r.fun,
    )
    return float(best.fun)


def test_geometric_median_random_against_scipy():
    P = np.random.default_rng(1234).standard_normal((7, 3)) * 3 + 1
    z = aggregators.build("geometric-median", 0)(torch.from_numpy(P.copy())).numpy()
    got, best = _sum_dist(z, P), _brute_force_min(P)
    assert got <= best * (1 + 1e-4)
    assert abs(got - best) <= 1e-4 * best


def test_geometric_median_collinear_is_the_middle_point():
    # rows a + t b with t = 0 1 2 5 9 -3 4: on a line the geometric median is a + median(t) b
    # median(t) = 2 -> a + 2b = (1,-2,0.5) + (2,4,6) = (3, 2, 6.5)
    a, b = np.array([1.0, -2.0, 0.5]), np.array([1.0, 2.0, 3.0])
    P = np.array([a + t * b for t in (0, 1, 2, 5, 9, -3, 4)])
    z = aggregators.build("geometric-median", 1)(torch.from_numpy(P.copy())).numpy()
    got, best = _sum_dist(z, P), _brute_force_min(P)
    assert abs(got - best) <= 1e-4 * best
    np.testing.assert_allclose(z, [3.0, 2.0, 6.5], atol=1e-5)


def test_geometric_median_symmetric_points():
    # 4 corners of a square around (1, 2) plus its centre: the centre is the median
    X = T([[0, 1], [2, 1], [0, 3], [2, 3], [1, 2]])
    close(aggregators.build("geometric-median", 1)(X), [1.0, 2.0], tol=1e-6)


# ------------------------------------------------------------------ centered clipping


def test_centered_clipping_first_call_then_previous_output_then_reset():
    agg = aggregators.build("centered-clipping:tau=5", f=1)
    X = T([[6, 8], [0, 4], [0, 0], [2, 0]])
    # call 1 from v=0: ||x_i|| = 10 4 0 2; only row 0 is clipped, by 5/10:
    # v = (1/4) [(3,4) + (0,4) + (0,0) + (2,0)] = (1/4)(5, 8) = (1.25, 2)
    close(agg(X), [1.25, 2.0])
    # call 2 starts from v = (1.25, 2): rows are v + offsets (6,8), (0,1), (-1,0), (0,-2)
    # with norms 10 1 1 2 -> the first is scaled by 5/10 to (3,4):
    # v = (1.25, 2) + (1/4)[(3,4) + (0,1) + (-1,0) + (0,-2)] = (1.25, 2) + (0.5, 0.75)
    X2 = T([[7.25, 10], [1.25, 3], [0.25, 2], [1.25, 0]])
    close(agg(X2), [1.75, 2.75])
    # after reset() call 1 is repeated exactly
    agg.rule.reset()
    close(agg(X), [1.25, 2.0])


def test_centered_clipping_second_call_differs_from_a_fresh_object():
    X2 = T([[7.25, 10], [1.25, 3], [0.25, 2], [1.25, 0]])
    # from zero: norms of X2 ~12.35, 3.25, 2.02, 1.25 -> row 0 clipped to norm 5, result is not
    # (1.75, 2.75) (that needs the previous centre (1.25, 2))
    fresh = aggregators.build("centered-clipping:tau=5", f=1)(X2)
    assert not torch.allclose(fresh, T([1.75, 2.75]))


def test_centered_clipping_two_iterations():
    # d=1, tau=1, rows 4 and 0. iter 1 from v=0: radii 4, 0 -> scales 1/4, 1
    #   v = (1/2)(4/4 + 0) = 0.5
    # iter 2: offsets 3.5, -0.5 -> radii 3.5, 0.5 -> scales 1/3.5, 1
    #   v = 0.5 + (1/2)(3.5/3.5 - 0.5) = 0.5 + 0.25 = 0.75
    close(aggregators.build("centered-clipping:tau=1,iters=2", 0)(T([[4], [0]])), [0.75])


def test_centered_clipping_large_tau_is_mean():
    # no row further than tau from v=0: one step lands on the mean (3, 5)
    close(aggregators.build("centered-clipping:tau=100", 0)(T([[1, 2], [3, 4], [5, 9]])), [3.0, 5.0])


# ------------------------------------------------------------------ MDA


MDA_X = [[0, 0], [2, 0], [3, 1], [10, 0], [1, 3]]  # A B C D E


def test_mda_f1():
    # squared distances: AB 4, AC 10, AD 100, AE 10, BC 2, BD 64, BE 10, CD 50, CE 8, DE 90
    # n-f = 4 rows: dropping D leaves {A,B,C,E}, diameter^2 max(4,10,10,2,10,8) = 10;
    # dropping A keeps DE (90); dropping B, C or E keeps AD (100) -> drop D
    # mean of A B C E = ((0+2+3+1)/4, (0+0+1+3)/4) = (1.5, 1)
    close(aggregators.build("mda", 1)(T(MDA_X)), [1.5, 1.0])


def test_mda_f2_tie_goes_to_lexicographically_first_excluded_set():
    # 3-row subsets: any subset with D has diameter^2 >= CD = 50; the four subsets of
    # {A,B,C,E} all have diameter^2 10: {A,B,C} (excl. 3,4), {A,B,E} (excl. 2,3),
    # {A,C,E} (excl. 1,3), {B,C,E} (excl. 0,3). First excluded set: (0,3) -> keep B C E
    # mean = ((2+3+1)/3, (0+1+3)/3) = (2, 4/3)
    close(aggregators.build("mda", 2)(T(MDA_X)), [2.0, 4 / 3])


def test_mda_f0_is_mean():
    close(aggregators.build("mda", 0)(T(MDA_X)), [16 / 5, 4 / 5])


# ------------------------------------------------------------------ SMEA


SMEA_X = [0, 0, 4, 4, 5, 9]


def T1(values) -> torch.Tensor:
    return torch.tensor([[float(v)] for v in values], dtype=F64)


def test_smea_keeps_the_subset_of_least_variance():
    # 4-row subsets of 0 0 4 4 5 9 (1-D: the covariance's eigenvalue is the variance):
    # {0,0,4,4}: mean 2, var (4+4+4+4)/4 = 4; {0,4,4,5}: mean 13/4, var (169+9+9+49)/16/4 = 236/64 = 3.6875;
    # {4,4,5,9}: mean 11/2, var (2.25+2.25+0.25+12.25)/4 = 4.25; {0,0,4,5}: var 5.1875; the others more.
    # {0,4,4,5} (either 0) wins -> 13/4
    agg = aggregators.build("smea", 2)
    close(agg(T1(SMEA_X)), [13 / 4])
    # excluded sets (0, 5) and (1, 5) tie (rows 0 and 1 are equal): the first, (0, 5), is used
    assert agg.rule.last_kept.tolist() == [False, True, True, True, True, False]


def test_mda_picks_the_smallest_range_where_smea_picks_the_smallest_variance():
    # the same rows: {0,0,4,4} has range 4, every other subset >= 5 -> MDA's mean is 2, SMEA's 13/4
    close(aggregators.build("mda", 2)(T1(SMEA_X)), [2.0])


def test_smea_uses_the_largest_eigenvalue_of_the_covariance():
    # square corners (0,0) (2,0) (0,2) (2,2) and (1,5), f = 1. Without (1,5): covariance diag(1, 1),
    # largest eigenvalue 1. Without a corner, e.g. (0,0): rows (2,0) (0,2) (2,2) (1,5), mean (5/4, 9/4),
    # covariance [[11/16, -1/16], [-1/16, 59/16]]: largest eigenvalue (70 + sqrt(48^2 + 4))/32 = 3.308...
    # (the other corners alike or larger) -> the mean of the square, (1, 1)
    close(aggregators.build("smea", 1)(T([[0, 0], [2, 0], [0, 2], [2, 2], [1, 5]])), [1.0, 1.0])


def test_smea_ties_go_to_the_first_excluded_set_within_its_tolerance():
    # 0 1 2 3, f = 1: {1,2,3} (excluding row 0) and {0,1,2} (excluding row 3) both have variance 2/3;
    # excluding row 0 comes first -> 2
    close(aggregators.build("smea", 1)(T1([0, 1, 2, 3])), [2.0])
    # raising the last row by 1e-13 makes {1,2,3} larger by a relative ~1e-13, below RTOL = 1e-9:
    # still a tie, so the choice cannot hang on the last bits a machine's LAPACK computes
    close(aggregators.build("smea", 1)(T1([0, 1, 2, 3 + 1e-13])), [(6 + 1e-13) / 3])


def test_smea_f0_is_mean():
    close(aggregators.build("smea", 0)(T(MDA_X)), [16 / 5, 4 / 5])


# ------------------------------------------------------------------ MoNNA


MONNA_X = [[0, 0], [1, 0], [0, 2], [10, 10], [3, 3]]


def test_monna_averages_the_neighbourhood_of_row_idx():
    # squared distances from row 0: 0, 1, 4, 200, 18 -> the 3 nearest (f = 2): rows 0 1 2 -> (1/3, 2/3)
    close(aggregators.build("monna", 2)(T(MONNA_X)), [1 / 3, 2 / 3])
    # from row 3: 200, 181, 164, 0, 98 -> rows 3 4 2 -> ((10+3+0)/3, (10+3+2)/3) = (13/3, 5)
    agg = aggregators.build("monna:idx=3", 2)
    close(agg(T(MONNA_X)), [13 / 3, 5.0])
    assert agg.rule.last_kept.tolist() == [False, False, True, True, True]


def test_monna_ties_go_to_the_lower_row():
    # 0 1 -1 3 -3 9 10, idx 0, f = 3: squared distances 0 1 1 9 9 81 100; four rows kept: 0, 1, 2 and,
    # of rows 3 and 4 (both at 9), the lower -> (0 + 1 - 1 + 3)/4 = 0.75
    close(aggregators.build("monna", 3)(T1([0, 1, -1, 3, -3, 9, 10])), [0.75])


# ------------------------------------------------------------------ CAF


def test_caf_f0_is_mean():
    X = T([[1, 2, 3], [4, -5, 6], [7, 8, -9], [0.5, 0, 1]])
    # mean = (12.5/4, 5/4, 1/4)
    close(aggregators.build("caf", 0)(X), [3.125, 1.25, 0.25])


CAF_INLIERS = [[0, 0], [1, 0], [0, 1], [1, 1], [0.5, 0.2], [0.3, 0.9]]


def test_caf_filters_one_outlier():
    X = T(CAF_INLIERS + [[10, 10]])
    inlier_mean = X[:6].mean(0)  # (2.8/6, 3.1/6)
    out = aggregators.build("caf", 1)(X)
    plain = X.mean(0)
    assert torch.linalg.norm(out - inlier_mean) < 0.1 * torch.linalg.norm(plain - inlier_mean)


# Regression tests: at commit 9edda2f caf looped forever on these inputs (the max of tau ran
# over rows already filtered out, so a far outlier with c_i = 0 kept the max and the live
# weights shrank by ~1e-13 per pass).


@pytest.mark.parametrize("outlier", [1e3, 1e6, 1e30])
def test_caf_far_outlier_terminates(outlier):
    X = T(CAF_INLIERS + [[outlier, outlier]])
    with time_limit(2.0):
        out = aggregators.build("caf", 1)(X)
    assert torch.linalg.norm(out - X[:6].mean(0)) < 0.1


def test_caf_d1_far_outlier_terminates():
    # rows 0 1 0 1 1e6, f=2: pass 1 zeroes the 1e6 row, later passes filter the live rows
    with time_limit(2.0):
        out = aggregators.build("caf", 2)(T([[0], [1], [0], [1], [1e6]]))
    assert 0.0 <= float(out) <= 1.0


# ------------------------------------------------------------------ clip


def test_clip_transform_and_chain():
    agg = aggregators.build("clip:c=5+mean", 0)
    X = T([[6, 8], [0, 3], [0, 0], [-5, 0]])
    # norms 10 3 0 5: only row 0 exceeds 5 -> scaled by 5/10 to (3,4); norm exactly 5 is kept
    Y = agg.pre[0].transform(X)
    close(Y, [[3, 4], [0, 3], [0, 0], [-5, 0]])
    # mean = ((3+0+0-5)/4, (4+3+0+0)/4) = (-0.5, 1.75)
    close(agg(X), [-0.5, 1.75])


def test_clip_default_c_is_one():
    # default c=1: (0, -4) -> (0, -1), (0.6, 0.8) has norm 1 -> kept
    Y = aggregators.build("clip+mean", 0).pre[0].transform(T([[0, -4], [0.6, 0.8]]))
    close(Y, [[0, -1], [0.6, 0.8]])


# ------------------------------------------------------------------ ARC


def test_arc_n5_f1():
    # k = floor(2 * (1/5) * 4) = floor(1.6) = 1: the largest-norm row is clipped to the
    # 2nd largest norm. norms: (3,4) 5, (0,20) 20, (1,0) 1, (0,2) 2, (-6,8) 10
    # -> (0,20) becomes (0,10)
    agg = aggregators.build("arc+mean", 1)
    X = T([[3, 4], [0, 20], [1, 0], [0, 2], [-6, 8]])
    close(agg.pre[0].transform(X), [[3, 4], [0, 10], [1, 0], [0, 2], [-6, 8]])
    # mean = ((3+0+1+0-6)/5, (4+10+0+2+8)/5) = (-0.4, 4.8)
    close(agg(X), [-0.4, 4.8])


def test_arc_n7_f2():
    # k = floor(2 * (2/7) * 5) = floor(20/7) = 2: the two largest norms (100, 50) are clipped
    # to the third largest norm, 5: 100 -> 5, -50 -> -5
    X = T([[1], [-2], [3], [100], [-50], [4], [5]])
    close(aggregators.build("arc+mean", 2).pre[0].transform(X), [[1], [-2], [3], [5], [-5], [4], [5]])


def test_arc_f0_changes_nothing():
    # k = 0
    X = T([[1], [-200], [3]])
    close(aggregators.build("arc+mean", 0).pre[0].transform(X), [[1], [-200], [3]])


# ------------------------------------------------------------------ NNM


def test_nnm_n4_f1():
    # each row -> mean of its n-f = 3 nearest rows (itself included); x = 0 1 3 10
    #   0: dist^2 0 1 9 100 -> {0,1,3} -> 4/3
    #   1: 1 0 4 81         -> {0,1,3} -> 4/3
    #   3: 9 4 0 49         -> {0,1,3} -> 4/3
    #  10: 100 81 49 0      -> {1,3,10} -> 14/3
    agg = aggregators.build("nnm+mean", 1)
    X = T([[0], [1], [3], [10]])
    close(agg.pre[0].transform(X), [[4 / 3], [4 / 3], [4 / 3], [14 / 3]])
    # mean of mixed rows = (4+4+4+14)/12 = 13/6
    close(agg(X), [13 / 6])


def test_nnm_tie_goes_to_lower_row():
    # x = 0 2 1, n=3, f=1 -> 2 nearest. row 2 (x=1) is at distance 1 from both others:
    # the lower row (0) wins -> (1+0)/2 = 0.5. row 0 -> {0, 1} = 0.5 ; row 1 (x=2) -> {2, 1} = 1.5
    X = T([[0], [2], [1]])
    close(aggregators.build("nnm+mean", 1).pre[0].transform(X), [[0.5], [1.5], [0.5]])


def test_nnm_d2():
    # (0,0) (2,0) (0,2) (5,5), f=1 -> 3 nearest each.
    # dist^2: 01=4, 02=4, 03=50, 12=8, 13=34, 23=34
    #  row0 -> {0,1,2} -> (2/3, 2/3); row1 -> {1,0,2} same; row2 -> same
    #  row3 -> {3, 1 (34), 2 (34)} -> ((5+2+0)/3, (5+0+2)/3) = (7/3, 7/3)
    X = T([[0, 0], [2, 0], [0, 2], [5, 5]])
    two = 2 / 3
    close(aggregators.build("nnm+mean", 1).pre[0].transform(X),
          [[two, two], [two, two], [two, two], [7 / 3, 7 / 3]])


# ------------------------------------------------------------------ bucketing


def _perm(n: int, seed: int) -> list[int]:
    # how aggregators/bucketing.py derives its permutation from (seed, n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def test_bucketing_known_permutation_seed0():
    assert _perm(5, 0) == [4, 0, 1, 3, 2]
    # buckets of s=2 over the permutation: {4,0}, {1,3}, {2}
    # x = 1 2 4 8 16 -> (16+1)/2 = 8.5, (2+8)/2 = 5, 4
    agg = aggregators.build("bucketing:s=2+mean", 0)
    X = T([[1], [2], [4], [8], [16]])
    Y = agg.pre[0].transform(X)
    assert Y.shape == (3, 1)  # ceil(5/2)
    close(Y, [[8.5], [5.0], [4.0]])
    # mean of bucket means = (8.5+5+4)/3 = 17.5/3 (not the plain mean 31/5)
    close(agg(X), [17.5 / 3])


def test_bucketing_known_permutation_seed7():
    assert _perm(5, 7) == [0, 1, 3, 2, 4]
    # buckets {0,1}, {3,2}, {4}: x = 1 2 4 8 16 -> 1.5, 6, 16 -> mean 23.5/3
    agg = aggregators.build("bucketing:s=2,seed=7+mean", 0)
    X = T([[1], [2], [4], [8], [16]])
    close(agg.pre[0].transform(X), [[1.5], [6.0], [16.0]])
    close(agg(X), [23.5 / 3])


@pytest.mark.parametrize("n, s, seed", [(7, 3, 3), (6, 2, 1), (6, 4, 11), (3, 5, 2)])
def test_bucketing_general(n, s, seed):
    X = torch.arange(n * 2, dtype=F64).reshape(n, 2) ** 2
    perm = _perm(n, seed)
    buckets = [perm[i : i + s] for i in range(0, n, s)]
    expected = torch.stack([X[b].sum(0) / len(b) for b in buckets])
    stage = aggregators.build(f"bucketing:s={s},seed={seed}+mean", 0).pre[0]
    assert stage.rows(n) == -(-n // s) == len(buckets)
    close(stage.transform(X), expected)


def test_bucketing_s1_is_a_permutation():
    X = T([[1], [2], [4], [8], [16]])
    Y = aggregators.build("bucketing:s=1+mean", 0).pre[0].transform(X)
    close(Y, X[_perm(5, 0)])


def test_bucketing_then_rule_sees_bucket_rows():
    # bucketing:s=2 (seed 0) on x = 1 2 4 8 16 gives 8.5 5 4; median of those = 5
    out = aggregators.build("bucketing:s=2+median", 1)(T([[1], [2], [4], [8], [16]]))
    close(out, [5.0])


# ------------------------------------------------------------------ chains


def test_arc_nnm_trimmed_mean_chain():
    # n=5, f=1. arc: k = 1 -> the row of norm 100 is clipped to the next norm 4: 100 -> 4
    #   rows: 0 1 2 4 4
    # nnm (4 nearest, self incl.): 0 -> {0,1,2,4(row3)} = 7/4 ; 1 -> {1,0,2,4(row3)} = 7/4
    #   2 -> {2,1,0,4(row3)} = 7/4 (dist 4,1,4,4: 0 and row3 tie at 4, lower rows 0 and 3 win
    #   over row 4) ; 4(row3) -> {4,4,2,1} = 11/4 ; 4(row4) -> same 11/4
    # trimmed-mean f=1 on 7/4 7/4 7/4 11/4 11/4 -> drop one of each end: (7/4+7/4+11/4)/3 = 25/12
    X = T([[0], [1], [2], [4], [100]])
    close(aggregators.build("arc+nnm+trimmed-mean", 1)(X), [25 / 12])


def test_selection_rules_record_the_rows_they_kept():
    X = torch.tensor([[0.0], [0.25], [0.5], [0.75], [1.0], [9.0], [-9.0]], dtype=torch.float64)
    krum = aggregators.build("krum", 2)
    krum(X)
    # scores (3 nearest): rows 0.25, 0.5, 0.75 all 0.375 exactly; the tie goes to the lowest row
    assert krum.last_kept.tolist() == [False, True, False, False, False, False, False]
    multi = aggregators.build("multi-krum:m=3", 2)
    multi(X)
    assert multi.last_kept.sum() == 3 and not multi.last_kept[5:].any()
    clipped = aggregators.build("clip:c=100+bulyan", 1)
    clipped(X)
    assert clipped.last_kept.sum() == 5 and not clipped.last_kept[5:].any()
    mixed = aggregators.build("nnm+krum", 2)
    mixed(X)
    # krum kept one row, but of nnm's mixtures: a mixed row stands for no node
    assert mixed.rule.last_kept.sum() == 1 and mixed.last_kept is None
    median = aggregators.build("median", 2)
    median(X)
    assert median.last_kept is None  # coordinate-wise: no row is kept or dropped as a whole
