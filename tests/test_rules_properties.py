"""Hypothesis properties of every rule and of pre-aggregator chains.

Sizes are small (n <= 12, d <= 5) so the whole file runs in seconds. ``caf`` calls run under
a time limit, so a regression of its endless loop (commit 9edda2f, see
test_rules_examples.py::test_caf_far_outlier_terminates) fails instead of hanging the suite.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import aggregators
from aggregators import RoundInputs
from robust.spec import parse

F64 = torch.float64
SETTINGS = settings(
    max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

RULES = aggregators.rules()
STATEFUL = {"centered-clipping", "foolsgold", "fldetector"}  # a call depends on the ones before
SELECTION_RULES = {"krum", "multi-krum", "bulyan", "mda", "smea", "monna", "loss-score"}
SORT_BASED = ["median", "trimmed-mean", "meamed", "sign-vote"]

FINITE = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
HUGE = st.floats(-1e30, 1e30, allow_nan=False, allow_infinity=False)


def max_f(rule: str, n: int) -> int:
    """Largest f the rule accepts for n rows (-1 if none)."""
    if rule in ("mean", "centered-clipping"):
        return n
    if rule in ("krum", "multi-krum"):
        return (n - 3) // 2
    if rule == "bulyan":
        return (n - 3) // 4
    # median: n >= 2f+1 ; trimmed-mean, meamed, geometric-median, mda, smea, monna, loss-score, caf: n > 2f
    return (n - 1) // 2


MIN_N = {r: (3 if r in ("krum", "multi-krum", "bulyan") else 1) for r in RULES}


def round_inputs(agg: aggregators.Chain, X: torch.Tensor, ids: list[str] | None = None) -> RoundInputs | None:
    """What a rule that needs more than the rows (fltrust, foolsgold, fldetector, loss-score) is
    given, ``None`` for the others: each row's node id (``ids``: they move with the rows under a
    permutation; default n00, n01, ...), a zero model, the rows' mean as the server's own update
    (a reference that a permutation or a shift moves as it moves the rows), and as each node's
    rating minus its row's distance to that mean (a rating that moves with the row)."""
    if not agg.needs:
        return None
    ids = tuple(ids or (f"n{i:02d}" for i in range(X.shape[0])))
    mean = X.mean(dim=0)
    return RoundInputs(ids=ids, w=torch.zeros(X.shape[1], dtype=X.dtype), reference=mean,
                       ratings=-(X - mean).double().norm(dim=1))


def run(spec: str, f: int, X: torch.Tensor, ids: list[str] | None = None) -> torch.Tensor:
    """A fresh aggregator applied to X (and to the inputs it needs besides)."""
    agg = aggregators.build(spec, f)
    return agg(X, round_inputs(agg, X, ids))


def scale_of(*tensors: torch.Tensor) -> float:
    return max([1.0] + [float(t.abs().max()) for t in tensors])


def assert_close(a: torch.Tensor, b: torch.Tensor, scale: float, rel: float = 1e-6) -> None:
    assert a.shape == b.shape
    assert float((a - b).abs().max()) <= rel * scale, (a, b)


# ------------------------------------------------------------------ strategies


@st.composite
def matrix(draw, n: int, d: int, elements=FINITE) -> torch.Tensor:
    """An (n, d) float64 matrix: free values, or a few values repeated (exact ties, equal rows)."""
    if n * d > 0 and draw(st.booleans()):
        pool = np.array(draw(st.lists(elements, min_size=1, max_size=4)), dtype=np.float64)
        pick = np.frombuffer(draw(st.binary(min_size=n * d, max_size=n * d)), dtype=np.uint8)
        return torch.from_numpy(pool[pick % len(pool)].reshape(n, d))
    return torch.from_numpy(draw(hnp.arrays(np.float64, (n, d), elements=elements)))


@st.composite
def rule_case(draw, rule: str, n_max: int = 12, d_max: int = 5):
    n = draw(st.integers(MIN_N[rule], n_max))
    d = draw(st.integers(1, d_max))
    f = draw(st.integers(0, max_f(rule, n)))
    return draw(matrix(n, d)), f


@st.composite
def generic_case(draw, rule: str, n_max: int = 12, d_max: int = 5):
    """Continuous random data (no exact or near ties with probability ~1)."""
    n = draw(st.integers(MIN_N[rule], n_max))
    d = draw(st.integers(1, d_max))
    f = draw(st.integers(0, max_f(rule, n)))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = 10.0 ** draw(st.integers(-3, 5))
    offset = draw(st.floats(-1e5, 1e5))
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((n, d)) * scale + offset), f


def case_for(rule: str):
    # caf's output jumps at exact ties between the tau_i of two rows (e.g. rows a, b, c with
    # b - a and c - a mirror images: both are zeroed in one pass, the loop stops and the plain
    # mean is returned; a rounding difference zeroes only one and a later pass returns ~a), and
    # float rounding after a shift or a reordering decides such ties: tie-free data for caf.
    return generic_case(rule) if rule == "caf" else rule_case(rule)


# ------------------------------------------------------------------ test oracles for ties
# Used only to decide whether an input is ambiguous (near-ties) for a selection rule.


def _sq_dist(X: torch.Tensor) -> np.ndarray:
    A = X.numpy()
    return ((A[:, None, :] - A[None, :, :]) ** 2).sum(-1)


def dist_tol(X: torch.Tensor, t: torch.Tensor | None = None) -> float:
    """Rounding slack on a sum of up to n squared distances (also after adding t to X)."""
    dmax = float(_sq_dist(X).max())
    spread = scale_of(X) if t is None else scale_of(X, t)
    return 1e-9 * X.shape[0] * (dmax + spread * dmax**0.5)


def krum_scores(X: torch.Tensor, f: int) -> np.ndarray:
    D = _sq_dist(X)
    n = D.shape[0]
    k = max(n - f - 2, 0)
    np.fill_diagonal(D, np.inf)
    return np.sort(D, axis=1)[:, :k].sum(1)


def row_index(X: torch.Tensor, row: torch.Tensor) -> int:
    hits = [i for i in range(X.shape[0]) if torch.equal(X[i], row)]
    assert hits, "output is not a row of X"
    return hits[0]


def multi_krum_unambiguous(X: torch.Tensor, f: int, m: int, tol: float) -> bool:
    """False when rows of different value have near-equal scores across the m-th boundary."""
    n = X.shape[0]
    if m >= n:
        return True
    s = krum_scores(X, f)
    order = np.argsort(s, kind="stable")
    inside, outside = s[order[m - 1]], s[order[m]]
    if outside - inside > tol:
        return True
    near = [i for i in range(n) if inside - tol <= s[i] <= outside + tol]
    return all(torch.equal(X[near[0]], X[i]) for i in near)


def subset_expected(X: torch.Tensor, f: int, score, tol: float) -> torch.Tensor | None:
    """Mean of the subset of n - f rows of least ``score``, or None when near-optimal subsets
    (within ``tol``) have different means."""
    n = X.shape[0]
    best = [(score(list(keep)), list(keep)) for keep in itertools.combinations(range(n), n - f)]
    lo = min(b[0] for b in best)
    means = [X[k].mean(0) for value, k in best if value <= lo + tol]
    if any(float((m - means[0]).abs().max()) > 1e-9 * scale_of(X) for m in means):
        return None
    return means[0]


def mda_expected(X: torch.Tensor, f: int, tol: float) -> torch.Tensor | None:
    D = _sq_dist(X)
    return subset_expected(X, f, lambda k: float(D[np.ix_(k, k)].max()), tol)


def smea_expected(X: torch.Tensor, f: int, tol: float) -> torch.Tensor | None:
    """SMEA by its definition: the largest eigenvalue of each subset's (d, d) covariance."""
    A = X.numpy()
    return subset_expected(X, f, lambda k: float(np.linalg.eigvalsh(np.atleast_2d(np.cov(A[k].T, bias=True)))[-1]), tol)


def monna_expected(X: torch.Tensor, f: int, idx: int, tol: float) -> torch.Tensor | None:
    """Mean of the n - f rows nearest to row idx, or None when rows of different value are near
    the boundary."""
    D = _sq_dist(X)[idx]
    order = np.argsort(D, kind="stable")
    keep = X.shape[0] - f
    if keep < X.shape[0]:
        inside, outside = D[order[keep - 1]], D[order[keep]]
        near = [i for i in range(X.shape[0]) if inside - tol <= D[i] <= outside + tol]
        if outside - inside <= tol and not all(torch.equal(X[near[0]], X[i]) for i in near):
            return None
    return X[order[:keep]].mean(0)


def bulyan_possible_selections(X: torch.Tensor, f: int) -> set:
    """Every selected multiset of row values Bulyan may pick when near-ties are broken any way
    (stops as soon as two differ)."""
    D = _sq_dist(X)
    n = X.shape[0]
    theta = n - 2 * f
    tol = dist_tol(X)
    results: set = set()
    seen: set = set()

    def walk(remaining: tuple) -> None:
        if len(results) > 1 or remaining in seen:
            return
        seen.add(remaining)
        if n - len(remaining) == theta:
            picked = sorted(set(range(n)) - set(remaining))
            results.add(tuple(sorted(tuple(X[i].tolist()) for i in picked)))
            return
        sub = D[np.ix_(remaining, remaining)].copy()
        k = max(len(remaining) - f - 2, 0)
        np.fill_diagonal(sub, np.inf)
        scores = np.sort(sub, axis=1)[:, :k].sum(1)
        for pos in np.flatnonzero(scores <= scores.min() + tol):
            walk(remaining[:pos] + remaining[pos + 1 :])

    walk(tuple(range(n)))
    return results


# ------------------------------------------------------------------ permutation invariance


@pytest.mark.parametrize("rule", [r for r in RULES if r not in SELECTION_RULES])
@SETTINGS
@given(data=st.data())
def test_permutation_invariance(rule, data):
    # median, trimmed-mean, meamed, sign-vote: bitwise; the others within 1e-6 relative
    X, f = data.draw(case_for(rule))
    perm = list(data.draw(st.permutations(range(X.shape[0]))))
    ids = [f"n{i:02d}" for i in range(X.shape[0])]
    a = run(rule, f, X.clone(), ids)
    b = run(rule, f, X[perm].clone(), [ids[i] for i in perm])  # each row keeps its node
    if rule in SORT_BASED:
        assert torch.equal(a, b)
    else:
        assert_close(a, b, scale_of(X))


@SETTINGS
@given(data=st.data())
def test_krum_permutation_invariance_by_score(data):
    X, f = data.draw(rule_case("krum"))
    perm = list(data.draw(st.permutations(range(X.shape[0]))))
    a = run("krum", f, X.clone())
    b = run("krum", f, X[perm].clone())
    if torch.equal(a, b):
        return
    s, tol = krum_scores(X, f), dist_tol(X)  # different rows: both must have the best score
    assert abs(s[row_index(X, a)] - s.min()) <= tol
    assert abs(s[row_index(X, b)] - s.min()) <= tol


@SETTINGS
@given(data=st.data())
def test_multi_krum_permutation_invariance(data):
    X, f = data.draw(rule_case("multi-krum"))
    n = X.shape[0]
    m = data.draw(st.one_of(st.none(), st.integers(1, n)))
    spec = "multi-krum" if m is None else f"multi-krum:m={m}"
    assume(multi_krum_unambiguous(X, f, n - f if m is None else m, dist_tol(X)))
    perm = list(data.draw(st.permutations(range(n))))
    assert_close(run(spec, f, X.clone()), run(spec, f, X[perm].clone()), scale_of(X))


def eigen_tol(X: torch.Tensor, t: torch.Tensor | None = None) -> float:
    """Rounding slack on a covariance eigenvalue of the rows of X (also after adding t to X),
    SMEA's own RTOL included."""
    return 1e-9 * float(_sq_dist(X).max()) + 1e-12 * (scale_of(X) if t is None else scale_of(X, t)) ** 2


SUBSET_RULES = {"mda": (mda_expected, dist_tol), "smea": (smea_expected, eigen_tol)}


@pytest.mark.parametrize("rule", SUBSET_RULES)
@SETTINGS
@given(data=st.data())
def test_subset_rule_permutation_invariance_and_optimality(rule, data):
    expected_of, tol = SUBSET_RULES[rule]
    X, f = data.draw(rule_case(rule, n_max=9))
    expected = expected_of(X, f, tol(X))
    assume(expected is not None)
    perm = list(data.draw(st.permutations(range(X.shape[0]))))
    assert_close(run(rule, f, X.clone()), expected, scale_of(X))
    assert_close(run(rule, f, X[perm].clone()), expected, scale_of(X))


@SETTINGS
@given(data=st.data())
def test_monna_follows_its_row_under_permutation(data):
    X, f = data.draw(rule_case("monna"))
    idx = data.draw(st.integers(0, X.shape[0] - 1))
    expected = monna_expected(X, f, idx, dist_tol(X))
    assume(expected is not None)
    perm = list(data.draw(st.permutations(range(X.shape[0]))))
    assert_close(run(f"monna:idx={idx}", f, X.clone()), expected, scale_of(X))
    assert_close(run(f"monna:idx={perm.index(idx)}", f, X[perm].clone()), expected, scale_of(X))


@SETTINGS
@given(data=st.data())
def test_bulyan_permutation_invariance_when_selection_is_unambiguous(data):
    # With f = 1 the last Krum round has 0 neighbours (every score 0) and with f = 2 one
    # neighbour (the closest pair ties), so on tie-free data the selection is unambiguous for
    # f = 0 or f >= 3 only; n up to 15 lets f reach 3.
    X, f = data.draw(generic_case("bulyan", n_max=15))
    assume(len(bulyan_possible_selections(X, f)) == 1)
    perm = list(data.draw(st.permutations(range(X.shape[0]))))
    assert_close(run("bulyan", f, X.clone()), run("bulyan", f, X[perm].clone()), scale_of(X))


def T1(values) -> torch.Tensor:
    return torch.tensor([[float(v)] for v in values], dtype=F64)


def test_bulyan_f1_last_round_ties_go_to_the_lowest_row():
    # values 20 25 4 37 39 29 7 (pairwise distances all different), n=7, f=1.
    # Krum rounds pick 29 (score 261), 25 (365), 7 (178), then 37 (score 4, tied with 39: mutual
    # nearest pair, lower row wins); the last round, 20 4 39, has n-f-2 = 0 neighbours, so all
    # scores tie at 0 and the lowest row index wins (the documented tie rule).
    # Rows in this order select 20: {7,20,25,29,37} -> median 25 -> (20+25+29)/3 = 74/3.
    # Swapping the first three rows (25 4 20 ...) selects 4: {4,7,25,29,37} -> (25+29+37)/3.
    agg = aggregators.build("bulyan", 1)
    assert_close(agg(T1([20, 25, 4, 37, 39, 29, 7])), torch.tensor([74 / 3], dtype=F64), 1.0)
    assert_close(agg(T1([25, 4, 20, 37, 39, 29, 7])), torch.tensor([91 / 3], dtype=F64), 1.0)


# ------------------------------------------------------------------ translation equivariance

TRANSLATION_RULES = ["mean", "median", "trimmed-mean", "meamed", "geometric-median", "caf"]


@pytest.mark.parametrize("rule", TRANSLATION_RULES)
@SETTINGS
@given(data=st.data())
def test_translation_equivariance(rule, data):
    X, f = data.draw(case_for(rule))
    if rule == "meamed":  # two values equally far from the median: rounding breaks the tie
        assume(not has_median_tie(X))
    t = data.draw(matrix(1, X.shape[1]))[0]
    assert_close(run(rule, f, X + t), run(rule, f, X) + t, scale_of(X, t))


def has_median_tie(X: torch.Tensor) -> bool:
    """Does some column hold two different values at the same distance from its median?"""
    for column in X.T:
        med = column.median() if len(column) % 2 else column.sort().values[len(column) // 2 - 1 : len(column) // 2 + 1].mean()
        dist = (column - med).abs()
        for i, j in itertools.combinations(range(len(column)), 2):
            if column[i] != column[j] and torch.isclose(dist[i], dist[j], rtol=1e-9, atol=0):
                return True
    return False


@SETTINGS
@given(data=st.data())
def test_krum_translation_equivariance_by_score(data):
    X, f = data.draw(rule_case("krum"))
    t = data.draw(matrix(1, X.shape[1]))[0]
    Xt = X + t
    i = row_index(X, run("krum", f, X))
    j = row_index(Xt, run("krum", f, Xt))
    if torch.equal(X[i], X[j]):
        return
    s, tol = krum_scores(X, f), dist_tol(X, t)  # different rows: both must have the best score
    assert abs(s[i] - s.min()) <= tol and abs(s[j] - s.min()) <= tol


@SETTINGS
@given(data=st.data())
def test_multi_krum_translation_equivariance(data):
    X, f = data.draw(rule_case("multi-krum"))
    n = X.shape[0]
    m = data.draw(st.one_of(st.none(), st.integers(1, n)))
    spec = "multi-krum" if m is None else f"multi-krum:m={m}"
    t = data.draw(matrix(1, X.shape[1]))[0]
    assume(multi_krum_unambiguous(X, f, n - f if m is None else m, dist_tol(X, t)))
    assert_close(run(spec, f, X + t), run(spec, f, X) + t, scale_of(X, t))


@pytest.mark.parametrize("rule", SUBSET_RULES)
@SETTINGS
@given(data=st.data())
def test_subset_rule_translation_equivariance(rule, data):
    expected_of, tol = SUBSET_RULES[rule]
    X, f = data.draw(rule_case(rule, n_max=9))
    t = data.draw(matrix(1, X.shape[1]))[0]
    expected = expected_of(X, f, tol(X, t))
    assume(expected is not None)
    assert_close(run(rule, f, X + t), expected + t, scale_of(X, t))


@SETTINGS
@given(data=st.data())
def test_monna_translation_equivariance(data):
    X, f = data.draw(rule_case("monna"))
    idx = data.draw(st.integers(0, X.shape[0] - 1))
    t = data.draw(matrix(1, X.shape[1]))[0]
    expected = monna_expected(X, f, idx, dist_tol(X, t))
    assume(expected is not None)
    assert_close(run(f"monna:idx={idx}", f, X + t), expected + t, scale_of(X, t))


@SETTINGS
@given(data=st.data())
def test_bulyan_translation_equivariance(data):
    # ties inside the selection are broken by row index, the same before and after the shift,
    # so tie-free (continuous random) data is enough here
    X, f = data.draw(generic_case("bulyan", n_max=15))
    t = torch.from_numpy(
        np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).uniform(-1e5, 1e5, X.shape[1])
    )
    assert_close(run("bulyan", f, X + t), run("bulyan", f, X) + t, scale_of(X, t))


# ------------------------------------------------------------------ robustness


@st.composite
def attacked_case(draw, rule: str):
    """f rows replaced by arbitrary finite values up to 1e30, at random positions."""
    n = draw(st.integers(MIN_N[rule], 12))
    d = draw(st.integers(1, 5))
    f = draw(st.integers(0, max_f(rule, n)))
    honest = draw(matrix(n - f, d))
    byz = draw(matrix(f, d, elements=HUGE))
    perm = list(draw(st.permutations(range(n))))
    return torch.cat([honest, byz])[perm], honest, f


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
@SETTINGS
@given(data=st.data())
def test_output_inside_honest_range(rule, data):
    X, honest, f = data.draw(attacked_case(rule))
    out = run(rule, f, X)
    lo, hi = honest.min(0).values, honest.max(0).values
    slack = 1e-12 * scale_of(honest)  # rounding of a float64 mean of values inside [lo, hi]
    assert bool((out >= lo - slack).all()) and bool((out <= hi + slack).all()), (out, lo, hi)


@pytest.mark.parametrize("rule", ["meamed", "bulyan"])
@SETTINGS
@given(data=st.data())
def test_output_near_honest_range(rule, data):
    # Mean-around-the-median rules can leave [lo, hi] (meamed of 0, 10 and a Byzantine 11 is
    # 10.5, see test_rules_examples.py): every averaged value is no further from the median
    # (which is inside [lo, hi]) than some discarded honest value, so out is in
    # [lo - w, hi + w] with w = hi - lo, whatever the Byzantine rows hold.
    X, honest, f = data.draw(attacked_case(rule))
    out = run(rule, f, X)
    lo, hi = honest.min(0).values, honest.max(0).values
    w = hi - lo
    slack = 1e-12 * scale_of(honest)
    assert bool((out >= lo - w - slack).all()) and bool((out <= hi + w + slack).all()), (out, lo, hi)


# ------------------------------------------------------------------ krum returns a row


@SETTINGS
@given(data=st.data())
def test_krum_output_is_an_input_row(data):
    X, _, f = data.draw(attacked_case("krum"))  # f of the rows may be huge
    out = run("krum", f, X)
    assert any(torch.equal(out, X[i]) for i in range(X.shape[0]))


# ------------------------------------------------------------------ no mutation, determinism, dtype


def _rows_after(spec: str, n: int) -> int:
    for part in spec.split("+")[:-1]:
        if part.startswith("bucketing"):
            s = int(part.split("s=")[1].split(",")[0])
            n = -(-n // s)
    return n


CHAINS = [
    "clip:c=1+mean",
    "arc+trimmed-mean",
    "nnm+krum",
    "arc+nnm+trimmed-mean",
    "bucketing:s=2,seed=5+median",
    "bucketing:s=3+centered-clipping:tau=1",
    "clip:c=10+nnm+geometric-median",
]
ALL_SPECS = RULES + CHAINS

def f_for(spec: str, n: int, f: int) -> int | None:
    """f (capped so the spec's rule can serve n rows), or None if no f works for n."""
    rule = spec.split("+")[-1].split(":")[0]
    f = min(f, max(0, max_f(rule, _rows_after(spec, n))))
    try:
        aggregators.build(spec, f).check_n(n)
    except ValueError:
        return None
    return f


@st.composite
def chain_input(draw, dtype=F64):
    n = draw(st.integers(1, 12))
    d = draw(st.integers(1, 5))
    f = draw(st.integers(0, 3))
    return draw(matrix(n, d)).to(dtype), f


def _assert_not_mutated(specs: list[str], X: torch.Tensor, f_drawn: int) -> None:
    for spec in specs:
        f = f_for(spec, X.shape[0], f_drawn)
        if f is None:
            continue
        before = X.clone()
        run(spec, f, X)
        assert torch.equal(X, before), f"{spec} (f={f}) modified its input"


@SETTINGS
@given(case=chain_input())
@example(case=(torch.tensor([[3.0], [1.0], [5.0], [2.0], [4.0]], dtype=F64), 0))
@example(case=(torch.tensor([[5e-324], [0.0], [0.0]], dtype=F64), 1))  # subnormal norm: clip made nan
def test_input_is_not_mutated(case):
    # every rule and chain; each example runs all of them
    _assert_not_mutated(ALL_SPECS, *case)


@pytest.mark.parametrize("rule", SORT_BASED)
def test_column_major_input_is_not_mutated(rule):
    X = torch.tensor([[3.0, 1.0, 2.0, 0.5, -1.0], [0.0, 5.0, 4.0, 1.0, 2.0]], dtype=F64).T  # (5, 2)
    before = X.clone()
    aggregators.build(rule, 1)(X)
    assert torch.equal(X, before)


@pytest.mark.parametrize("rule", SORT_BASED)
def test_column_major_input_gives_the_same_output(rule):
    X = torch.tensor([[3.0, 1.0, 2.0, 0.5, -1.0], [0.0, 5.0, 4.0, 1.0, 2.0]], dtype=F64)
    expected = aggregators.build(rule, 1)(X.T.contiguous())
    assert torch.equal(aggregators.build(rule, 1)(X.clone().T), expected)  # column-major view


@SETTINGS
@given(data=st.data())
def test_deterministic_and_keeps_dtype(data):
    # for every rule and chain: the same input twice gives bitwise the same output
    # (a STATEFUL rule: two fresh objects; the others: one object called twice),
    # and the output is a finite (d,) tensor of the input's dtype, float32 or float64
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    X, f_drawn = data.draw(chain_input(dtype))
    for spec in ALL_SPECS:
        f = f_for(spec, X.shape[0], f_drawn)
        if f is None:
            continue
        a = run(spec, f, X.clone())  # fresh object (caf: under a time limit)
        if STATEFUL & {c.name for c in parse(spec)}:
            b = run(spec, f, X.clone())
        else:
            agg = aggregators.build(spec, f)
            agg(X.clone(), round_inputs(agg, X))
            b = agg(X.clone(), round_inputs(agg, X))  # the same object, second call
        assert torch.equal(a, b), spec
        assert a.dtype == dtype and a.shape == (X.shape[1],) and a.device == X.device, spec
        assert bool(torch.isfinite(a).all()), spec


def test_float32_and_float64_outputs_for_every_spec():
    X = torch.tensor([[0.5, 1.0], [2.0, -1.0], [1.5, 0.0], [-3.0, 2.5], [1.0, 1.0],
                      [0.0, 0.25], [4.0, -2.0]], dtype=F64)
    for spec in ALL_SPECS:
        for dtype in (torch.float32, torch.float64):
            out = run(spec, 1, X.to(dtype))
            assert out.dtype == dtype, spec


def test_centered_clipping_is_stateful_same_object():
    agg = aggregators.build("centered-clipping:tau=1", 0)
    X = torch.tensor([[10.0, 0.0], [0.0, 10.0]], dtype=F64)
    a, b = agg(X), agg(X)
    assert not torch.equal(a, b)
    agg.rule.reset()
    assert torch.equal(agg(X), a)


@pytest.mark.parametrize("name", sorted(n for n in aggregators.REGISTRY.names() if not aggregators.REGISTRY.entries[n].uses_f))
def test_a_stage_that_says_f_does_not_change_its_output_is_right(name):
    # robust bench --tune moves f only for a chain whose output depends on it (evaluation.bench.tune)
    spec = name if aggregators.REGISTRY.entries[name].is_rule else f"{name}+mean"
    for seed in range(5):
        X = torch.randn(11, 4, generator=torch.Generator().manual_seed(seed), dtype=F64)
        X[-2:] += 30.0  # two outliers: a rule that trims, selects or weighs by f would treat them by f
        assert torch.equal(run(spec, 1, X), run(spec, 3, X)), (name, seed)


def test_the_stages_that_use_f_are_the_ones_that_trim_select_or_weigh_by_it():
    uses = sorted(n for n in aggregators.REGISTRY.names() if aggregators.REGISTRY.entries[n].uses_f)
    assert {"trimmed-mean", "krum", "multi-krum", "nnm", "bulyan", "meamed", "mda", "smea", "monna", "loss-score",
            "dnc", "caf", "arc"} <= set(uses)
    assert aggregators.build("bucketing:s=2+centered-clipping", 2).uses_f is False
    assert aggregators.build("nnm+trimmed-mean", 2).uses_f is True
