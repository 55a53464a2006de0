"""Every error of aggregators.build and of a built aggregator: a ValueError that says what to change."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import aggregators

F64 = torch.float64


def X_(n: int, d: int = 3, dtype=F64) -> torch.Tensor:
    return torch.arange(n * d, dtype=dtype).reshape(n, d) / 7.0


# ------------------------------------------------------------------ building from a spec


def test_unknown_rule_lists_every_choice():
    with pytest.raises(ValueError) as err:
        aggregators.build("krumm", 1)
    msg = str(err.value)
    assert msg.startswith("unknown aggregator 'krumm' in 'krumm': choose from ")
    listed = msg.split("choose from ", 1)[1].split(", ")
    assert listed == aggregators.names()


def test_unknown_stage_inside_a_chain():
    with pytest.raises(ValueError, match=r"unknown aggregator 'nmm' in 'nmm\+krum': choose from arc, bucketing"):
        aggregators.build("nmm+krum", 1)


def test_unknown_parameter():
    with pytest.raises(ValueError, match=re.escape("krum: unknown key q (known: none)")):
        aggregators.build("krum:q=1", 1)


def test_unknown_parameter_lists_the_known_ones():
    with pytest.raises(
        ValueError,
        match=re.escape("centered-clipping: unknown key radius (known: iters, tau)"),
    ):
        aggregators.build("centered-clipping:radius=3", 1)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("multi-krum:m=2.5", "multi-krum: m must be an integer >= 1 (got m=2.5)"),
        ("multi-krum:m=true", "multi-krum: m must be an integer >= 1 (got m=True)"),
        ("multi-krum:m=five", "multi-krum: m must be an integer >= 1 (got m='five')"),
        ("bucketing:s=2.0+mean", "bucketing: s must be an integer >= 1 (got s=2.0)"),
        ("bucketing:seed=x+mean", "bucketing: seed must be an integer >= 0 (got seed='x')"),
        ("clip:c=true+mean", "clip: c must be a number > 0 (got c=True)"),
        ("centered-clipping:tau=big", "centered-clipping: tau must be a number > 0 (got tau='big')"),
        ("geometric-median:max_iter=1e3", "geometric-median: max_iter must be an integer >= 1 (got max_iter=1000.0)"),
    ],
)
def test_wrong_parameter_type(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        aggregators.build(spec, 0)


def test_int_is_accepted_for_a_float_parameter():
    agg = aggregators.build("centered-clipping:tau=2", 0)
    assert agg.rule.tau == 2.0 and type(agg.rule.tau) is float


def test_spec_ending_with_a_pre_aggregator():
    with pytest.raises(
        ValueError,
        match=re.escape("'nnm' ends with the pre-aggregator 'nnm': end it with a rule, e.g. 'nnm+trimmed-mean'"),
    ):
        aggregators.build("nnm", 1)


def test_chain_ending_with_a_pre_aggregator():
    with pytest.raises(ValueError, match=re.escape("e.g. 'arc+bucketing+trimmed-mean'")):
        aggregators.build("arc+bucketing", 1)


def test_rule_followed_by_more_stages():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "'krum' is a final rule but is followed by more stages in 'krum+mean': "
            "only pre-aggregators (arc, bucketing, clip, nnm) may come before the rule"
        ),
    ):
        aggregators.build("krum+mean", 1)


def test_spec_errors_surface_through_build():
    with pytest.raises(ValueError, match=r"empty component .*remove the doubled or trailing '\+'"):
        aggregators.build("nnm+", 1)
    with pytest.raises(ValueError, match=r"write key=value"):
        aggregators.build("multi-krum:m", 1)


# ------------------------------------------------------------------ f and parameter values


@pytest.mark.parametrize("f", [-1, -5, 1.5, True, "1", None])
def test_bad_f(f):
    with pytest.raises(ValueError, match=re.escape(f"f must be a whole number >= 0 (got {f!r})")):
        aggregators.build("mean", f)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("centered-clipping:tau=0", "centered-clipping: tau must be a number > 0 (got tau=0)"),
        ("centered-clipping:tau=-2", "centered-clipping: tau must be a number > 0 (got tau=-2)"),
        ("centered-clipping:iters=0", "centered-clipping: iters must be an integer >= 1 (got iters=0)"),
        ("clip:c=0+mean", "clip: c must be a number > 0 (got c=0)"),
        ("clip:c=-1.5+mean", "clip: c must be a number > 0 (got c=-1.5)"),
        ("bucketing:s=0+mean", "bucketing: s must be an integer >= 1 (got s=0)"),
        ("bucketing:s=-3+mean", "bucketing: s must be an integer >= 1 (got s=-3)"),
        ("geometric-median:nu=0", "geometric-median: nu must be a number > 0 (got nu=0)"),
        ("geometric-median:nu=-1e-6", "geometric-median: nu must be a number > 0 (got nu=-1e-06)"),
        ("geometric-median:max_iter=0", "geometric-median: max_iter must be an integer >= 1 (got max_iter=0)"),
        ("geometric-median:tol=-1", "geometric-median: tol must be a number >= 0 (got tol=-1)"),
        ("multi-krum:m=0", "multi-krum: m must be an integer >= 1 (got m=0)"),
    ],
)
def test_bad_parameter_values(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        aggregators.build(spec, 1)


@pytest.mark.parametrize(
    "spec",
    ["geometric-median:nu=nan", "geometric-median:nu=inf", "centered-clipping:tau=nan", "clip:c=nan+mean"],
)
def test_non_finite_parameter_values_are_refused(spec):
    with pytest.raises(ValueError, match=r"must be"):
        aggregators.build(spec, 0)


def test_multi_krum_m_above_n():
    agg = aggregators.build("multi-krum:m=8", 1)
    with pytest.raises(ValueError, match=re.escape("multi-krum m=8 exceeds the n=7 rows: lower m")):
        agg(X_(7))


# ------------------------------------------------------------------ n too small for f


def test_krum_n6_f2():
    with pytest.raises(ValueError) as err:
        aggregators.build("krum", 2)(X_(6))
    assert "krum needs n >= 2f + 3 (got n=6, f=2)" in str(err.value)
    assert str(err.value).endswith(": lower f or add nodes")


@pytest.mark.parametrize(
    "spec, n, f, formula",
    [
        ("multi-krum", 4, 1, ">= 2f + 3"),
        ("bulyan", 6, 1, ">= 4f + 3"),
        ("bulyan", 10, 2, ">= 4f + 3"),
        ("trimmed-mean", 4, 2, "> 2f"),
        ("trimmed-mean", 2, 1, "> 2f"),
        ("median", 4, 2, ">= 2f + 1"),
        ("meamed", 6, 3, "> 2f"),
        ("geometric-median", 2, 1, "> 2f"),
        ("mda", 4, 2, "> 2f"),
        ("smea", 4, 2, "> 2f"),
        ("monna", 4, 2, "> 2f"),
        ("caf", 4, 2, "> 2f"),
        ("nnm+mean", 4, 2, "> 2f"),
        ("arc+mean", 2, 1, "> 2f"),
    ],
)
def test_n_too_small(spec, n, f, formula):
    name = spec.split("+")[0].split(":")[0]
    with pytest.raises(
        ValueError,
        match=re.escape(f"{name} needs n {formula} (got n={n}, f={f}): lower f or add nodes"),
    ):
        aggregators.build(spec, f)(X_(n))


def test_n_is_checked_before_any_work():
    # the check does not depend on the data: a chain refuses n up front, even with huge rows
    agg = aggregators.build("nnm+bulyan", 2)
    with pytest.raises(ValueError, match=r"bulyan needs n >= 4f \+ 3 \(got n=10, f=2\)"):
        agg(torch.full((10, 2), 1e300, dtype=F64))


def test_chain_error_says_what_reaches_the_rule():
    agg = aggregators.build("bucketing:s=2+krum", 1)
    with pytest.raises(ValueError) as err:
        agg(X_(8))
    msg = str(err.value)
    assert msg.startswith("krum needs n >= 2f + 3 (got n=4, f=1): lower f or add nodes")
    assert msg.endswith("[n=4 is what reaches krum from 8 rows]")


def test_chain_error_through_two_bucketings():
    agg = aggregators.build("bucketing:s=2+bucketing:s=2+trimmed-mean", 1)
    with pytest.raises(ValueError, match=re.escape("[n=2 is what reaches trimmed-mean from 7 rows]")):
        agg(X_(7))
    assert agg(X_(9)).shape == (3,)  # 9 -> 5 -> 3 rows: enough for f=1


@pytest.mark.parametrize("rule, instead", [("mda", "multi-krum"), ("smea", "nnm+trimmed-mean")])
def test_a_subset_search_above_its_limit_is_refused_before_any_work(rule, instead):
    agg = aggregators.build(rule, 20)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{rule} would examine C(n=60, f=20) = 4,191,844,505,805,495 subsets, above its limit of "
            f"1,000,000: lower f, or use an approximate rule such as {instead}"
        ),
    ):
        agg(torch.full((60, 2), 1e300, dtype=F64))


def test_monna_refuses_an_idx_that_names_no_row():
    with pytest.raises(ValueError, match=re.escape("monna: idx=5 names no row of the n=5 given: choose idx between 0 and 4")):
        aggregators.build("monna:idx=5", 1)(X_(5))
    assert aggregators.build("monna:idx=4", 1)(X_(5)).shape == (3,)


def test_mda_at_a_size_below_the_limit_is_served():
    # C(20, 7) = 77,520 subsets: allowed
    assert aggregators.build("mda", 1)(X_(20, 2)).shape == (2,)
    aggregators.build("mda", 7).check_n(20)


# ------------------------------------------------------------------ bad input


def test_non_finite_rows_are_named():
    X = X_(7)
    X[2, 1] = float("nan")
    X[5, 0] = float("inf")
    for spec in ("mean", "krum", "nnm+trimmed-mean", "centered-clipping"):
        with pytest.raises(
            ValueError,
            match=re.escape("rows [2, 5] contain NaN or Inf: reject those updates before aggregation"),
        ):
            aggregators.build(spec, 1)(X)


def test_minus_inf_and_float32_rows_are_named():
    X = X_(5, 2, torch.float32)
    X[0, 0] = -float("inf")
    X[4, 1] = float("nan")
    with pytest.raises(ValueError, match=re.escape("rows [0, 4] contain NaN or Inf")):
        aggregators.build("median", 1)(X)


def test_huge_finite_rows_are_accepted():
    # a row sum may overflow (1e308 + 1e308) without the row being non-finite
    X = torch.tensor([[1e308, 1e308], [1.0, 2.0], [3.0, 4.0]], dtype=F64)
    assert torch.equal(aggregators.build("median", 1)(X), torch.tensor([3.0, 4.0], dtype=F64))


@pytest.mark.parametrize(
    "value, type_name",
    [(np.zeros((3, 2)), "ndarray"), ([[1.0, 2.0], [3.0, 4.0]], "list"), (None, "NoneType")],
)
def test_non_tensor_input(value, type_name):
    with pytest.raises(
        ValueError,
        match=re.escape(f"updates must be a torch.Tensor of shape (n, d) (got {type_name})"),
    ):
        aggregators.build("mean", 0)(value)


@pytest.mark.parametrize(
    "shape",
    [(5,), (), (2, 3, 4), (0, 3), (3, 0)],
)
def test_bad_shape(shape):
    with pytest.raises(
        ValueError,
        match=re.escape(f"updates must have shape (n, d) with n, d >= 1 (got {shape})"),
    ):
        aggregators.build("mean", 0)(torch.zeros(shape, dtype=F64))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float16, torch.bfloat16, torch.bool])
def test_bad_dtype(dtype):
    with pytest.raises(
        ValueError,
        match=re.escape(f"updates must be float32 or float64 (got {dtype}): convert with X.float()"),
    ):
        aggregators.build("median", 0)(torch.ones(3, 2, dtype=dtype))


def test_integer_input_message():
    with pytest.raises(ValueError, match=re.escape("(got torch.int64): convert with X.float()")):
        aggregators.build("krum", 0)(torch.arange(9).reshape(3, 3))


# ------------------------------------------------------------------ centered clipping state


def test_centered_clipping_refuses_a_new_d():
    agg = aggregators.build("centered-clipping", 1)
    first = agg(X_(4, 3))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "centered-clipping last aggregated d=3 coordinates, now d=4: "
            "build a new aggregator (or reset()) for a new model"
        ),
    ):
        agg(X_(4, 4))
    # the failed call left the state alone: the next d=3 call continues from `first`
    fresh = aggregators.build("centered-clipping", 1)
    fresh(X_(4, 3))
    assert torch.equal(agg(X_(4, 3)), fresh(X_(4, 3)))
    assert first.shape == (3,)


def test_centered_clipping_reset_accepts_a_new_d():
    agg = aggregators.build("centered-clipping", 1)
    agg(X_(4, 3))
    agg.rule.reset()
    assert agg(X_(4, 5)).shape == (5,)


def test_errors_leave_the_input_untouched():
    X = X_(6)
    before = X.clone()
    with pytest.raises(ValueError):
        aggregators.build("krum", 2)(X)
    assert torch.equal(X, before)


@pytest.mark.parametrize("spec, f, least", [("mean", 0, 1), ("krum", 1, 5), ("bulyan", 1, 7),
                                            ("nnm+trimmed-mean", 2, 5), ("mda", 5, 11)])
def test_least_n_is_the_fewest_rows_a_chain_serves(spec, f, least):
    chain = aggregators.build(spec, f)
    assert chain.least_n() == least
    chain.check_n(least)
    if least > 1:
        with pytest.raises(ValueError):
            chain.check_n(least - 1)
