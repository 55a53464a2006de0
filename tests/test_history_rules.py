"""The rules that need more than the rows (RoundInputs): FLTrust, FoolsGold, FLDetector.

The interface (missing or malformed inputs, build-time checks), hand-computed examples, the
detections they are for, order invariance with ids, and resume from state() to the same bits.
test_rules_properties.py leaves these rules out: it calls rule(X) without inputs.
"""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import aggregators
from aggregators import RoundInputs
from aggregators.fldetector import hessian_coefficients, pairs_and_step, two_clusters
from robust.geometry import weighted_sum
from robust.source import Memory
from tests.test_rules_properties import SETTINGS, assert_close, matrix, scale_of

F64 = torch.float64
IDS = tuple(f"node-{i:02d}" for i in range(10))
T = lambda rows: torch.tensor(rows, dtype=F64)  # noqa: E731


def close(got: torch.Tensor, expected, tol: float = 1e-12) -> None:
    exp = torch.as_tensor(expected, dtype=got.dtype)
    assert got.shape == exp.shape and torch.allclose(got, exp, rtol=tol, atol=tol), (got, exp)


def resumed(agg):
    """A fresh chain of the same spec, loaded from ``agg.state()`` through torch.save/load."""
    buffer = io.BytesIO()
    torch.save(agg.state(), buffer)
    other = aggregators.build(agg.spec, agg.f)
    other.load_state(torch.load(io.BytesIO(buffer.getvalue())))
    return other


# ------------------------------------------------------------------ the interface


def test_registered_with_their_needs():
    needs = {r: aggregators.build(r, 0).needs for r in aggregators.rules()}
    assert {r: k for r, k in needs.items() if k} == {
        "fltrust": {"reference"}, "foolsgold": {"ids"}, "fldetector": {"ids", "w"}, "loss-score": {"ratings"}}


ABC = ("a", "b", "c")


@pytest.mark.parametrize("spec, inputs, message", [
    ("foolsgold", None, "foolsgold needs the node id of each row: call the chain with RoundInputs(ids=...)"),
    ("fltrust", RoundInputs(ids=ABC), "fltrust needs the server's own update (d,) on its root data: "
     "call the chain with RoundInputs(reference=...)"),
    ("clip+fldetector", None, "fldetector needs the node id of each row and the flat global model (d,) the rows "
     "were computed from: call the chain with RoundInputs(ids=..., w=...)"),
    ("foolsgold", RoundInputs(ids=ABC[:2]),
     "ids has 2 entries for n=3 rows: pass one node id per row, in the rows' order"),
    ("mean", RoundInputs(ids=["a", "b", "a"]), "ids repeats 'a': each row must come from a different node"),
    ("foolsgold", RoundInputs(ids=(1, 2, 3)), "ids must be strings (got int): pass each node's id as a str"),
    ("fltrust", RoundInputs(reference=torch.zeros(5)), "fltrust: reference has shape (5,), the rows have d=7"),
    ("fltrust", RoundInputs(reference=torch.full((7,), math.nan)), "fltrust: reference contains NaN or Inf"),
    ("fldetector", RoundInputs(ids=ABC, w=torch.zeros(1, 7)), "fldetector: w has shape (1, 7), the rows have d=7"),
    ("fldetector", RoundInputs(ids=ABC, w=[0.0] * 7), "fldetector: w must be a torch.Tensor of shape (d,) (got list)"),
])
def test_bad_inputs_say_what_to_pass(spec, inputs, message):
    agg = aggregators.build(spec, 1)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        agg(torch.ones(3, 7, dtype=F64), inputs)
    assert agg.state() == {}  # checked before any work


def test_which_pre_aggregators_may_precede():
    for spec, rule in [("nnm+foolsgold", "foolsgold"), ("clip+bucketing+fldetector", "fldetector")]:
        with pytest.raises(ValueError, match=re.escape(
            f"{spec!r}: {rule} tracks each node across rounds, so no pre-aggregator that mixes rows (bucketing, nnm)"
        )):
            aggregators.build(spec, 1)
    X = torch.randn(6, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    inputs = RoundInputs(ids=IDS[:6], reference=X.mean(0), w=torch.zeros(4, dtype=F64))
    for spec in ["clip:c=1+fltrust", "bucketing+fltrust", "nnm+fltrust", "arc+clip+foolsgold", "arc+fldetector"]:
        out = aggregators.build(spec, 1)(X, inputs)
        assert out.shape == (4,) and bool(torch.isfinite(out).all()), spec
    for spec in ["median", "nnm+krum", "bucketing+mean"]:  # rules without needs ignore inputs
        agg = aggregators.build(spec, 1)
        assert torch.equal(agg(X, inputs), agg(X))


@pytest.mark.parametrize("spec", ["fltrust", "foolsgold", "fldetector"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_input_not_modified_and_dtype_kept(spec, dtype):
    X = torch.randn(9, 6, generator=torch.Generator().manual_seed(4), dtype=F64).to(dtype).T.contiguous().T
    before, agg = X.clone(), aggregators.build(spec, 2)
    for t in range(3):  # column-major rows, float32 or float64: every call leaves them alone
        out = agg(X, RoundInputs(ids=IDS[:9], w=X[0] * t, reference=X[:3].mean(0)))
        assert torch.equal(X, before) and out.dtype == dtype and out.shape == (6,)


@SETTINGS
@given(data=st.data())
def test_same_weights_for_the_same_rows_in_any_order(data):
    # fltrust (one call) and foolsgold (two rounds, ids and rows permuted together): the
    # weights are the same bits, the aggregates the same up to rounding
    n, d = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 5))
    rounds, g0 = [data.draw(matrix(n, d)) for _ in range(2)], data.draw(matrix(1, d))[0]
    runs = []
    for order in (list(range(n)), data.draw(st.permutations(range(n)))):
        trust, gold = aggregators.build("fltrust", 0), aggregators.build("foolsgold", 0)
        outs = [trust(rounds[0][order], RoundInputs(reference=g0))]
        outs += [gold(X[order], RoundInputs(ids=tuple(IDS[i] for i in order))) for X in rounds]
        runs.append((outs, trust.rule.last_weights, gold.rule.last_weights, order))
    (a, trust_a, gold_a, _), (b, trust_b, gold_b, perm) = runs
    assert torch.equal(trust_a[perm], trust_b) and torch.equal(gold_a[perm], gold_b)
    for x, y in zip(a, b):
        assert_close(x, y, scale_of(*rounds, g0))


# ------------------------------------------------------------------ fltrust


def fltrust(X: torch.Tensor, g0):
    agg = aggregators.build("fltrust", 0)
    return agg(X, RoundInputs(reference=torch.as_tensor(g0, dtype=X.dtype))), agg.last_kept


def test_fltrust_by_hand():
    # g0 = (3, 4), ||g0|| = 5. cos: (1,0) 3/5, (0,2) 4/5, (-1,0) -3/5 -> TS 0.6 0.8 0.
    # rescaled to norm 5: (5,0) (0,5) -> (0.6 (5,0) + 0.8 (0,5)) / 1.4 = (15/7, 20/7)
    out, kept = fltrust(T([[1, 0], [0, 2], [-1, 0]]), [3.0, 4.0])
    close(out, [15 / 7, 20 / 7])
    assert kept.tolist() == [True, True, False]
    # a zero row and a row at 90 degrees get TS 0; (2,2) has TS 1/sqrt2 and is rescaled to
    # norm 1 -> the output is (2,2)/sqrt8 = (1,1)/sqrt2 whatever its weight
    out, kept = fltrust(T([[0, 0], [0, -3], [2, 2]]), [1.0, 0.0])
    close(out, [2**-0.5, 2**-0.5])
    assert kept.tolist() == [False, False, True]
    for X, g0 in [(T([[-1, 0], [0, -2], [-1, -1]]), [1.0, 1.0]), (T([[1, 0], [0, 2]]), [0.0, 0.0])]:
        out, kept = fltrust(X, g0)  # nothing trusted (a zero reference trusts nothing): 0
        assert torch.equal(out, torch.zeros(2, dtype=F64)) and not kept.any()


def test_fltrust_rescales_every_row_to_the_reference_norm():
    X = torch.randn(6, 5, dtype=F64, generator=torch.Generator().manual_seed(3)).abs()
    out, _ = fltrust(X, X.mean(0))
    for big in (100.0, 1e200):  # 1e200: squares overflow float64, the row is rescaled exactly
        close(fltrust(X * T([1, 1, big, 1, 1, 1])[:, None], X.mean(0))[0], out)
    assert torch.linalg.vector_norm(out) <= torch.linalg.vector_norm(X.mean(0)) * (1 + 1e-12)


# ------------------------------------------------------------------ foolsgold


def foolsgold(spec: str, rows, ids: str):
    agg = aggregators.build(spec, 0)
    return agg(T(rows), RoundInputs(ids=tuple(ids))), agg


def test_foolsgold_by_hand():
    # a = (1,0), b = (cos 60, sin 60), c = (-1,0): cs_ab = 0.5, cs_ac = -1, cs_bc = -0.5, the
    # diagonal 0 -> v = 0.5 0.5 0. c is pardoned to 0 by a and b (v_c / v_a = 0); 1 - max:
    # 0.5 0.5 1 -> /1, 1 -> 0.99 -> logit: ln(1) + 0.5 = 0.5 for a and b, ln 99 + 0.5 -> 1 for c
    # F = (0.5 a + 0.5 b + c) / 2 = (-0.125, sqrt3/8); kappa = 2: weights 1 1 1 -> (1/6, sqrt3/6)
    rows = [[1, 0], [0.5, 3**0.5 / 2], [-1, 0]]
    out, agg = foolsgold("foolsgold", rows, "abc")
    close(out, [-0.125, 3**0.5 / 8])
    close(agg.rule.last_weights, [0.5, 0.5, 1.0])
    close(foolsgold("foolsgold:kappa=2", rows, "abc")[0], [1 / 6, 3**0.5 / 6])
    # twins a, b (cosine 1) weigh 0, c (orthogonal) 1: F = c; every node with a twin: F = 0
    out, agg = foolsgold("foolsgold", [[1, 0], [2, 0], [0, 1]], "abc")
    close(out, [0.0, 1.0])
    assert agg.last_kept.tolist() == [False, False, True]
    out, agg = foolsgold("foolsgold", [[1, 0], [2, 0], [0, 1], [0, 3]], "abcd")
    assert torch.equal(out, torch.zeros(2, dtype=F64)) and not agg.last_kept.any()


def test_foolsgold_pardons_and_compares_histories():
    # unit rows with cos(a,b) = 0.3, cos(a,c) = 0.2, cos(b,c) = 0.6 (the Cholesky rows of their
    # Gram matrix): v = 0.3 0.6 0.6; a is pardoned by b and c (x 0.3/0.6): max 0.15 -> 1 - max:
    # 0.85 0.4 0.4 -> /0.85: a 1 -> 0.99 -> 1; b, c: r = 0.4/0.85, ln(r/(1-r)) + 0.5 = ln(8/9) + 0.5
    # (without pardoning a would be 0.7 and b, c 0.4/0.7 -> ln(4/3) + 0.5)
    cy = 0.54 / 0.91**0.5
    rows = [[1, 0, 0], [0.3, 0.91**0.5, 0], [0.2, cy, (0.96 - cy * cy) ** 0.5]]
    out, agg = foolsgold("foolsgold", rows, "abc")
    wb = math.log(8 / 9) + 0.5
    close(agg.rule.last_weights, [1.0, wb, wb], 1e-9)
    close(out, (T(rows[0]) + wb * (T(rows[1]) + T(rows[2]))) / (1 + 2 * wb), 1e-9)
    # rows orthogonal in both rounds (round 1: weights 1 1 1, the mean), but in round 2 the
    # histories of a and b are twins (1,1,0): weight ~0, c keeps 1 -> F = c's row
    agg = aggregators.build("foolsgold", 0)
    close(agg(T([[1, 0, 0], [0, 1, 0], [0, 0, 1]]), RoundInputs(ids=ABC)), [1 / 3, 1 / 3, 1 / 3])
    close(agg(T([[0, 1, 0], [1, 0, 0], [0, 0, 1]]), RoundInputs(ids=ABC)), [0, 0, 1])
    assert agg.last_kept.tolist() == [False, False, True]


def sybil_rounds(rounds: int):
    """8 honest nodes with their own directions (+ noise), 2 sybils (rows 8, 9) pushing one goal."""
    g = torch.Generator().manual_seed(0)
    goal, own = torch.randn(50, generator=g, dtype=F64), torch.randn(8, 50, generator=g, dtype=F64)
    for _ in range(rounds):
        honest = own + torch.randn(8, 50, generator=g, dtype=F64)
        yield torch.cat([honest, goal + 0.01 * torch.randn(2, 50, generator=g, dtype=F64)])


def test_foolsgold_weighs_sybils_out_resumes_and_takes_late_joiners():
    a, b = aggregators.build("foolsgold", 2), None
    for t, X in enumerate(sybil_rounds(5)):
        n = 9 if t < 2 else 10  # node-09 joins in round 2: before, node-08 has no twin
        out = a(X[:n], RoundInputs(ids=IDS[:n]))
        assert a.last_kept.tolist() == ([True] * 9 if n == 9 else [True] * 8 + [False] * 2)
        w = a.rule.last_weights
        close(out, (w[:, None] * X[:n]).sum(0) / w.sum())
        if b is not None:  # resumed after round 2: the same bits
            assert torch.equal(b(X, RoundInputs(ids=IDS)), out) and torch.equal(b.rule.last_weights, w)
        b = resumed(a) if t == 2 else b
    a(X[:4], RoundInputs(ids=IDS[:4]))  # absent nodes keep their histories
    assert sorted(a.state()) == [f"0.history.{i}" for i in IDS]
    with pytest.raises(ValueError, match=re.escape("foolsgold holds histories of d=50 coordinates, now d=3")):
        a(torch.ones(4, 3, dtype=F64), RoundInputs(ids=IDS[:4]))


# ------------------------------------------------------------------ fldetector


def quadratic(rounds: int, attack: str = "flip", spec: str = "fldetector:window=3", dtype=F64, absent=None):
    """Rows x_i = A w + b_i + noise (Hessian A, eigenvalues in [0.5, 2]); nodes 3 and 7 flip
    theirs or send noise; node ``absent[t]`` sends nothing in round t; w <- w - 0.1 F.
    Yields (round, rows, inputs, agg) after each call."""
    g = torch.Generator().manual_seed(0)
    Q = torch.linalg.qr(torch.randn(20, 20, generator=g, dtype=F64))[0]
    A = Q @ torch.diag(torch.linspace(0.5, 2.0, 20, dtype=F64)) @ Q.T
    b = torch.randn(20, generator=g, dtype=F64) + 0.5 * torch.randn(10, 20, generator=g, dtype=F64)
    w, agg = 5 * torch.randn(20, generator=g, dtype=F64), aggregators.build(spec, 2)
    for t in range(rounds):
        X = w @ A + b + 0.01 * torch.randn(10, 20, generator=g, dtype=F64)
        X[[3, 7]] = -X[[3, 7]] if attack == "flip" else 3 * torch.randn(2, 20, generator=g, dtype=F64)
        rows = [i for i in range(10) if i != (absent or {}).get(t)]
        X, inputs = X[rows].to(dtype), RoundInputs(ids=tuple(IDS[i] for i in rows), w=w.to(dtype))
        w = w - 0.1 * agg(X, inputs).to(F64)
        yield t, X, inputs, agg


@pytest.mark.parametrize("attack, dtype", [("flip", F64), ("noise", F64), ("flip", torch.float32)])
def test_fldetector_excludes_rows_that_do_not_follow_the_model(attack, dtype):
    # window 3: the first pair exists after call 1, scores from call 2, full windows at call 4
    for t, _, _, agg in quadratic(10, attack, dtype=dtype):
        assert agg.last_kept.tolist() == ([True] * 10 if t < 4 else [i not in (3, 7) for i in range(10)]), t
    for t, _, _, agg in quadratic(12, spec="fldetector"):  # window 10: candidates from call 11
        assert bool(agg.last_kept.all()) == (t < 11), t


def test_fldetector_an_absent_node_is_scored_again_after_two_rounds():
    scores = lambda agg: agg.rule.scores.get(IDS[5], torch.zeros(0)).numel()  # noqa: E731
    counts = [scores(agg) for _, _, _, agg in quadratic(8, spec="fldetector:window=5", absent={4: 5})]
    assert counts == [0, 0, 1, 2, 2, 2, 3, 4]  # absent at 4, no previous row at 5


def test_fldetector_same_bits_in_any_order_and_after_resume():
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()
    b, again = aggregators.build("fldetector:window=3", 2), None
    for t, X, inputs, a in quadratic(9):
        out = b(X[perm], RoundInputs(ids=tuple(inputs.ids[i] for i in perm), w=inputs.w))
        assert torch.equal(out, a.rule.out) and torch.equal(b.last_kept, a.last_kept[perm])  # median: bitwise
        if again is not None:
            assert torch.equal(again(X, inputs), a.rule.out) and torch.equal(again.last_kept, a.last_kept)
        again = resumed(a) if t == 4 else again
    assert not a.last_kept.all()  # the rounds compared include detections


def test_hessian_vector_is_the_bfgs_update_of_sigma_identity():
    # B_0 = sigma I, B_{k+1} = B_k - B_k s s^T B_k / s^T B_k s + y y^T / y^T s over the pairs:
    # the compact form must give B_m v, and the last secant equation B_m s_m = y_m
    g = torch.Generator().manual_seed(8)
    A = torch.randn(12, 12, generator=g, dtype=F64)
    S = torch.randn(3, 12, generator=g, dtype=F64)
    Y = S @ (A @ A.T + torch.eye(12, dtype=F64)) + 0.01 * torch.randn(3, 12, generator=g, dtype=F64)
    B = (Y[-1] @ S[-1]) / (S[-1] @ S[-1]) * torch.eye(12, dtype=F64)
    for s, y in zip(S, Y):
        B = B - torch.outer(B @ s, B @ s) / (s @ B @ s) + torch.outer(y, y) / (y @ s)
    v = torch.randn(12, generator=g, dtype=F64)
    zero = Memory(torch.zeros(1, 12, dtype=F64))  # the step v = v - 0
    for step, expected in [(v, B @ v), (S[-1].clone(), Y[-1])]:
        Z = pairs_and_step(Memory(S), Memory(Y), step, zero)
        close(weighted_sum(Z, hessian_coefficients(Z)), expected, 1e-9)


def test_two_clusters_by_gap_statistic():
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert two_clusters(T([0.01, 0.012, 0.011, 0.4, 0.013, 0.41]), gen()) == 4  # 4 low, 2 high
    assert two_clusters(torch.linspace(0, 1, 10, dtype=F64), gen()) == 0  # evenly spread: one
    assert two_clusters(T([0.1, 0.1, 0.1]), gen()) == 0


def test_parameters_and_checks():
    for spec, message in [("fldetector:window=0", "fldetector: window must be an integer >= 1"),
                          ("fldetector:base=krum", "fldetector: base must be one of median, mean (got base='krum')"),
                          ("foolsgold:kappa=0", "foolsgold: kappa must be a number > 0")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            aggregators.build(spec, 1)
    with pytest.raises(ValueError, match=re.escape("fldetector needs n >= 2f + 1 (got n=4, f=2)")):
        aggregators.build("fldetector", 2).check_n(4)
    aggregators.build("fldetector:base=mean", 2).check_n(1)
    agg = next(quadratic(1))[3]
    with pytest.raises(ValueError, match=re.escape("fldetector last saw d=20 coordinates, now d=3")):
        agg(torch.ones(5, 3, dtype=F64), RoundInputs(ids=IDS[:5], w=torch.zeros(3, dtype=F64)))
