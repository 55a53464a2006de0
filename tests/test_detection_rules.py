"""The rules that detect and drop rows: DnC, SignGuard, FLAME.

Hand-computed examples (worked out in the comments), outlier removal with ``last_kept``,
the seeding contract (same rows in any order -> same draws; new rows -> new draws), parameter
and row-count errors. Their generic properties (input not modified, dtype, order invariance)
are in test_rules_properties.py, which enumerates every registered rule.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

import aggregators

F64 = torch.float64
RULES = ["dnc", "signguard", "flame"]


def T(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def close(got: torch.Tensor, expected, tol: float = 1e-12) -> None:
    exp = torch.as_tensor(expected, dtype=F64)
    assert got.shape == exp.shape
    assert torch.allclose(got, exp, rtol=tol, atol=tol), (got, exp)


def test_registered_as_rules():
    assert set(RULES) <= set(aggregators.rules())


# ------------------------------------------------------------------ outliers removed

OUTLIERS = [3, 7]  # positions of the two Byzantine rows among 10


def attacked(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """8 honest rows around a mean with every coordinate in [1, 2] (so every honest value is
    positive), and 2 Byzantine rows at positions 3 and 7; returns (X, honest rows)."""
    g = torch.Generator().manual_seed(0)
    mean = 1.0 + torch.rand(40, generator=g, dtype=F64)
    honest = mean + 0.1 * torch.randn(8, 40, generator=g, dtype=F64)
    byzantine = {
        "sign-flip": -honest[:2],  # same norms, every sign flipped
        # long rows pushing one random direction together (DnC scores along one direction per
        # subset: two outliers in unrelated directions would not both stand out on it)
        "far": 10.0 * torch.randn(40, generator=g, dtype=F64) + 0.1 * torch.randn(2, 40, generator=g, dtype=F64),
        "scaled": 10.0 * honest[:2],  # the honest direction and signs, 10x the norm
    }[kind]
    rows = [*honest[:3], byzantine[0], *honest[3:6], byzantine[1], *honest[6:]]
    return torch.stack(rows), honest


def honest_kept(kept: torch.Tensor) -> torch.Tensor:
    return kept[[i for i in range(10) if i not in OUTLIERS]]


@pytest.mark.parametrize("kind", ["sign-flip", "far", "scaled"])
def test_dnc_removes_the_outliers(kind):
    # the two outliers dominate the top singular direction of every subset: each iteration
    # removes exactly them (floor(c f) = 2), so the good set is the 8 honest rows
    X, honest = attacked(kind)
    agg = aggregators.build("dnc", 2)
    close(agg(X), honest.mean(0), tol=1e-10)
    assert agg.last_kept.tolist() == [i not in OUTLIERS for i in range(10)]


@pytest.mark.parametrize("kind", ["sign-flip", "far", "scaled"])
def test_signguard_removes_the_outliers(kind):
    # sign-flip: same norms, caught by the sign statistics (honest rows are all positive);
    # scaled: same signs, caught by the norm filter (10x > 3x the median norm); far: both
    X, honest = attacked(kind)
    agg = aggregators.build("signguard", 2)
    out = agg(X)
    assert agg.last_kept.tolist() == [i not in OUTLIERS for i in range(10)]
    # the kept rows are clipped to the median norm, so the output is near (not at) their mean
    assert torch.linalg.vector_norm(out - honest.mean(0)) < 0.02 * torch.linalg.vector_norm(honest.mean(0))


@pytest.mark.parametrize("kind", ["sign-flip", "far"])
def test_flame_removes_the_outliers(kind):
    # cosine distance ~2 (sign-flip) or ~1 (a random direction) from the honest cluster, whose
    # rows are within ~0.01 of each other: HDBSCAN leaves the outliers out of the cluster
    X, honest = attacked(kind)
    agg = aggregators.build("flame", 2)
    out = agg(X)
    assert not agg.last_kept[OUTLIERS].any()
    assert honest_kept(agg.last_kept).sum() >= 1
    plain = X.mean(0)
    assert torch.linalg.vector_norm(out - honest.mean(0)) < 0.05 * torch.linalg.vector_norm(honest.mean(0))
    assert torch.linalg.vector_norm(out - honest.mean(0)) < 0.1 * torch.linalg.vector_norm(plain - honest.mean(0))


def test_flame_clips_what_its_cluster_keeps():
    # rows 10x an honest row point the honest way, so FLAME's clustering keeps them, but they
    # are clipped to the median norm: the output stays near the honest mean, the plain mean
    # does not
    X, honest = attacked("scaled")
    out = aggregators.build("flame", 2)(X)
    plain = X.mean(0)
    assert torch.linalg.vector_norm(out - honest.mean(0)) < 0.05 * torch.linalg.vector_norm(honest.mean(0))
    assert torch.linalg.vector_norm(plain - honest.mean(0)) > 1.0 * torch.linalg.vector_norm(honest.mean(0))


# ------------------------------------------------------------------ hand-computed examples


def test_dnc_1d():
    # d = 1: every subset is the one coordinate; mu = 106/5 = 21.2, scores (x - mu)^2 =
    # 449.44 408.04 368.64 331.24 6146.44 -> the row 100 is removed (floor(c f) = 1)
    # -> (0+1+2+3)/4 = 1.5
    agg = aggregators.build("dnc", 1)
    close(agg(T([[0], [1], [2], [3], [100]])), [1.5])
    assert agg.last_kept.tolist() == [True, True, True, True, False]


def test_dnc_f0_is_the_mean():
    agg = aggregators.build("dnc", 0)
    close(agg(T([[1, 2], [3, 4], [5, 9]])), [3.0, 5.0])
    assert agg.last_kept.all()


def test_dnc_empty_intersection_keeps_the_rows_removed_least_often():
    # each coordinate has its own outlier: a subset of b = 1 coordinate removes the row that is
    # large there. 30 subsets draw all three coordinates (all but surely), so every row is
    # removed by some subset and the intersection of the kept sets is empty; the good set is
    # the rows removed by the fewest subsets, whose mean is returned (not a mean of nothing)
    X = T([[10, 0, 0], [0, 10, 0], [0, 0, 10]])
    agg = aggregators.build("dnc:b=1,iters=30", 1)
    out = agg(X)
    kept = agg.last_kept
    assert bool(torch.isfinite(out).all()) and 1 <= int(kept.sum()) <= 3
    close(out, X[kept].mean(0))


def test_signguard_clips_to_the_median_norm():
    # rows t u with u = (0.6, 0.8), t = 1 20 2 3 4: median norm M = 3, norm filter [0.3, 9]
    # drops t = 20; all signs positive -> one cluster. Kept t 1 2 3 4 clipped to 3:
    # 1 2 3 3 -> mean 9/4 u = (1.35, 1.8)
    u = T([0.6, 0.8])
    X = torch.stack([t * u for t in (1.0, 20.0, 2.0, 3.0, 4.0)])
    agg = aggregators.build("signguard", 2)
    close(agg(X), [1.35, 1.8])
    assert agg.last_kept.tolist() == [True, False, True, True, True]


def test_signguard_falls_back_to_the_norm_filter():
    # frac = 1: the statistics use all 4 coordinates. A = 5e-4 (1,1,1,1) three times,
    # B = -0.5 (1,1,1,1) and C = 0.5 (1,-1,1,-1) twice each.
    # norms: A 1e-3, B 1, C 1 -> M = 1 (4th of 7), the norm filter [0.1, 3] keeps B and C.
    # statistics (pos, zero, neg): A (1,0,0), B (0,0,1), C (.5,0,.5); the bandwidth is the mean
    # distance to the 3rd nearest row (itself counted): 0 for A, sqrt(.5) for B and C ->
    # 4 sqrt(.5)/7 = 0.404 < the distances between the groups: three clusters, the largest A.
    # A and the norm filter do not meet: the norm filter's rows are kept, none clipped
    # -> mean of B B C C = (0, -0.5, 0, -0.5)
    a = 5e-4
    A, B, C = [a, a, a, a], [-0.5] * 4, [0.5, -0.5, 0.5, -0.5]
    agg = aggregators.build("signguard:frac=1", 3)
    close(agg(T([A, B, C, A, B, C, A])), [0.0, -0.5, 0.0, -0.5])
    assert agg.last_kept.tolist() == [False, True, True, False, True, True, False]


def test_flame_without_noise():
    # rows (2,0) (0,3) (1,0) (-3,-4) (4,0): the three along (1,0) are at cosine distance 0 from
    # each other, (0,3) at 1 and (-3,-4) at 1.6 from them: min_cluster_size = 3, the cluster is
    # the three. Median norm of 2 3 1 5 4 = 3: kept 2 1 4 clipped to 2 1 3 -> mean (2, 0)
    agg = aggregators.build("flame:noise=0", 2)
    close(agg(T([[2, 0], [0, 3], [1, 0], [-3, -4], [4, 0]])), [2.0, 0.0])
    assert agg.last_kept.tolist() == [True, False, True, False, True]


def test_flame_noise_has_std_noise_times_the_median_norm():
    # rows t u, u a unit vector of d = 20000 coordinates, t = 1 2 3 4 5: one cluster, median
    # norm S = 3; the noise is N(0, (0.1 S)^2) per coordinate -> std 0.3
    u = torch.ones(20000, dtype=F64) / 20000**0.5
    X = torch.stack([t * u for t in (1.0, 2.0, 3.0, 4.0, 5.0)])
    quiet = aggregators.build("flame:noise=0", 2)(X)
    noisy = aggregators.build("flame:noise=0.1", 2)(X)
    std = float((noisy - quiet).std())
    assert abs(std - 0.3) < 0.015, std


def test_flame_single_row_is_kept():
    agg = aggregators.build("flame:noise=0", 0)
    close(agg(T([[1.5, -2.0]])), [1.5, -2.0])
    assert agg.last_kept.tolist() == [True]


# ------------------------------------------------------------------ seeding


@pytest.mark.parametrize("rule", RULES)
def test_same_rows_same_bits(rule):
    X, _ = attacked("far")
    agg = aggregators.build(rule, 2)
    first = agg(X)
    kept = agg.last_kept.clone()
    assert torch.equal(agg(X), first) and torch.equal(agg.last_kept, kept)  # the object again
    assert torch.equal(aggregators.build(rule, 2)(X.clone()), first)  # a fresh object
    assert agg.rule.state() == {}  # nothing carried between calls: a resume replays the same bits


@pytest.mark.parametrize("rule", RULES)
def test_rows_in_any_order(rule):
    # the draws and the kept set are exactly the same; the mean only up to summation order
    X, _ = attacked("sign-flip")
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    a, b = aggregators.build(rule, 2), aggregators.build(rule, 2)
    close(b(X[perm]), a(X), tol=1e-12)
    assert torch.equal(b.last_kept, a.last_kept[perm])


def test_dnc_breaks_exact_ties_by_content_not_position():
    # rows 0 1 2, f = 1: scores (x - 1)^2 = 1 0 1, rows 0 and 2 tie for removal; the tie goes
    # by content, so every order of the rows removes the same one (-> 0.5 or 1.5, always)
    outputs = set()
    for perm in itertools.permutations([0.0, 1.0, 2.0]):
        agg = aggregators.build("dnc", 1)
        outputs.add(float(agg(T([[v] for v in perm]))))
        assert int(agg.last_kept.sum()) == 2
    assert len(outputs) == 1 and outputs <= {0.5, 1.5}


def test_flame_noise_depends_on_seed_and_rows():
    X, _ = attacked("far")
    noise = lambda spec, Y: aggregators.build(spec, 2)(Y) - aggregators.build("flame:noise=0", 2)(Y)  # noqa: E731
    base = noise("flame:noise=0.5", X)
    assert torch.equal(noise("flame:noise=0.5,seed=0", X), base)  # seed=0 is the default
    assert not torch.allclose(noise("flame:noise=0.5,seed=1", X), base)
    Y = X.clone()
    Y[0, 0] += 1e-9  # new rows (a new round): a new draw
    assert not torch.allclose(noise("flame:noise=0.5", Y), base)


def dnc_pick(seed: int, X: torch.Tensor) -> int:
    """Which row dnc:b=1,iters=1 removes: the outlier of the one coordinate it draws."""
    agg = aggregators.build(f"dnc:b=1,iters=1,seed={seed}", 1)
    agg(X)
    return int((~agg.last_kept).nonzero())


def test_dnc_draws_depend_on_seed_and_rows():
    # row 0 is the outlier of coordinate 0, row 1 of coordinate 1: the drawn coordinate
    # decides which is removed. Over 12 seeds (or 12 variants of the honest rows) both are
    # drawn; each choice is a function of (seed, rows) only
    X = T([[10, 0], [0, 10], [0.1, 0.2], [0.3, 0.1], [0.2, 0.3]])
    by_seed = [dnc_pick(s, X) for s in range(12)]
    assert set(by_seed) == {0, 1}
    assert [dnc_pick(s, X) for s in range(12)] == by_seed
    by_rows = [dnc_pick(0, torch.cat([X[:2], X[2:] + 0.01 * k])) for k in range(12)]
    assert set(by_rows) == {0, 1}


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "spec, message",
    [
        ("dnc:iters=0", "dnc: iters must be an integer >= 1 (got iters=0)"),
        ("dnc:b=0", "dnc: b must be an integer >= 1 (got b=0)"),
        ("dnc:c=0", "dnc: c must be a number > 0 (got c=0)"),
        ("signguard:lower=1.5", "signguard: lower must be a number in [0, 1] (got lower=1.5)"),
        ("signguard:upper=0.5", "signguard: upper must be a number >= 1 (got upper=0.5)"),
        ("signguard:frac=0", "signguard: frac must be a number in (0, 1] (got frac=0)"),
        ("signguard:frac=1.5", "signguard: frac must be a number in (0, 1]"),
        ("flame:noise=-0.1", "flame: noise must be a number >= 0 (got noise=-0.1)"),
        ("flame:lambda=0.01", "flame: unknown key lambda (known: noise, seed)"),
    ],
)
def test_bad_parameters(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        aggregators.build(spec, 1)


@pytest.mark.parametrize("rule", RULES)
def test_needs_an_honest_majority(rule):
    X = torch.arange(12, dtype=F64).reshape(4, 3)
    with pytest.raises(ValueError, match=re.escape(f"{rule} needs n > 2f (got n=4, f=2): lower f or add nodes")):
        aggregators.build(rule, 2)(X)
    aggregators.build(rule, 2).check_n(5)


def test_dnc_cannot_remove_every_row():
    with pytest.raises(ValueError, match=re.escape(
        "dnc removes floor(c*f) = 6 rows per subset, not fewer than the n=5 rows (c=3.0, f=2): lower c"
    )):
        aggregators.build("dnc:c=3", 2).check_n(5)
    aggregators.build("dnc:c=3", 2).check_n(7)


# ------------------------------------------------------------------ input


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_input_is_not_modified(rule, dtype):
    X, _ = attacked("far")
    X = X.to(dtype).T.contiguous().T  # column-major as well
    before = X.clone()
    out = aggregators.build(rule, 2)(X)
    assert torch.equal(X, before)
    assert out.dtype == dtype and out.shape == (40,)
