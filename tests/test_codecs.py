"""robust.codecs: round trips and error bounds, bytes on the wire, error feedback, rand-k's
unbiasedness, scaled sign, the spec errors, and decode as the gate for untrusted input."""

from __future__ import annotations

import math
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from robust import codecs

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECS = ["none", "fp16", "int8", "topk:k=0.01", "randk:k=0.01", "sign", "shared-sign"]
KEY = (7, 3, "node-a")  # (run seed, round, node id)

F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def rows(elements=F32, max_d: int = 300):
    """Finite float32 rows of 1..max_d coordinates, as tensors."""
    return hnp.arrays(np.float32, st.integers(1, max_d), elements=elements).map(torch.from_numpy)


def bits(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def round_trip(spec: str, x: torch.Tensor, key: tuple = KEY) -> tuple[codecs.Encoded, torch.Tensor]:
    codec = codecs.build(spec)
    enc = codec.encode(x, key)
    return enc, codec.decode(enc, x.numel())


# ---------------------------------------------------------------- round trips and error bounds


@SETTINGS
@given(rows())
def test_none_is_lossless_to_the_bit(x):
    _, y = round_trip("none", x)
    assert y.dtype == torch.float32 and bits(y) == bits(x)


@SETTINGS
@given(rows())
def test_fp16_is_round_to_nearest_half_saturating_at_65504(x):
    enc, y = round_trip("fp16", x)
    assert enc["x"].dtype == np.float16
    assert bits(y) == bits(x.clamp(-65504, 65504).half().float())
    inside = x.abs() <= 65504
    err = (x - y).abs()[inside].double()
    bound = torch.maximum(x.abs()[inside].double() * 2.0**-11, torch.tensor(2.0**-25))
    assert bool((err <= bound).all())
    assert bool((y[~inside] == 65504 * x[~inside].sign()).all())  # saturated, not infinite


def test_fp16_saturates_instead_of_overflowing():
    _, y = round_trip("fp16", torch.tensor([1e6, -3e38, 65519.0, 1.0]))
    assert y.tolist() == [65504.0, -65504.0, 65504.0, 1.0]


@SETTINGS
@given(rows(), st.integers(1, 64))
def test_int8_error_is_at_most_half_a_step_per_coordinate(x, block):
    codec = codecs.build(f"int8:block={block}")
    enc = codec.encode(x)
    y = codec.decode(enc, x.numel())
    q, scale = enc["q"], enc["scale"]
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (math.ceil(x.numel() / block),)
    assert np.abs(q.astype(int)).max() <= 127
    step = torch.from_numpy(np.repeat(scale, block)[: x.numel()]).double()
    amax = torch.nn.functional.pad(x.abs().double(), (0, scale.size * block - x.numel())).view(-1, block).amax(1)
    assert bool((torch.from_numpy(scale).double() >= amax / 127 * (1 - 1e-6)).all())  # never much below max|x|/127
    err = (x.double() - y.double()).abs()
    assert bool((err <= step * (0.5 + 1e-5) + 1e-44).all())


def test_int8_scale_is_max_abs_over_127_per_block_rounded_up():
    x = torch.tensor([1.0, -127.0, 3.0, 0.0, 0.0, 0.5, 0.0, 0.0])
    enc = codecs.build("int8:block=2").encode(x)
    assert enc["q"].tolist() == [1, -127, 127, 0, 0, 127, 0, 0]
    scale = enc["scale"]
    assert scale[0] == 1.0 and scale[3] == 0.0  # exact where max|x| / 127 is a float32; zero block: zero
    for b, amax in ((1, 3.0), (2, 0.5)):  # the float32 just at or above max|x| / 127
        assert float(scale[b]) >= amax / 127 > float(np.nextafter(scale[b], np.float32(0)))


def test_int8_handles_rows_at_float32_extremes():
    big = float(np.finfo(np.float32).max)
    x = torch.tensor([big, -big, 1e-45, 0.0])
    codec = codecs.build("int8:block=4")
    y = codec.decode(codec.encode(x), 4)
    assert bool(torch.isfinite(y).all()) and abs(float(y[0]) - big) <= big * 1e-6
    tiny = codecs.build("int8").encode(torch.tensor([1e-45, 0.0]))
    assert tiny["scale"][0] > 0 and tiny["q"].tolist() == [1, 0]  # a subnormal block still gets a scale


@SETTINGS
@given(rows(), st.floats(1e-3, 1.0))
def test_topk_keeps_the_m_largest_with_ties_to_the_lowest_index(x, k):
    codec = codecs.build(f"topk:k={k}")
    d = x.numel()
    enc = codec.encode(x)
    y = codec.decode(enc, d)
    idx = torch.from_numpy(enc["idx"]).long()
    m = max(1, math.ceil(k * d - 1e-9))
    assert idx.numel() == m == codec.count(d)
    assert bool((idx[1:] > idx[:-1]).all())
    assert bits(y[idx]) == bits(x[idx]) and int((y != 0).sum()) <= m
    dropped = torch.ones(d, dtype=torch.bool)
    dropped[idx] = False
    if dropped.any():
        a = x.abs()
        assert float(a[idx].min()) >= float(a[dropped].max())
        tie = float(a[idx].min())  # every dropped coordinate tied at the threshold comes after the kept ones
        later_ties = dropped & (a == tie)
        if later_ties.any():
            assert int(later_ties.nonzero().min()) > int(idx[a[idx] == tie].max())


def test_topk_ties_are_deterministic():
    enc = codecs.build("topk:k=0.3").encode(torch.ones(10))
    assert enc["idx"].tolist() == [0, 1, 2]
    enc = codecs.build("topk:k=0.2").encode(torch.tensor([1.0, -2.0, 0.0, 2.0, -2.0]))
    assert enc["idx"].tolist() == [1] and enc["val"].tolist() == [-2.0]


@pytest.mark.parametrize("k, d, m", [(0.07, 100, 7), (0.01, 10_000, 100), (0.01, 5, 1), (1e-9, 3, 1),
                                     (1.0, 9, 9), (0.3, 10, 3), (0.25, 10, 3)])
def test_kept_count_is_ceil_of_the_decimal_k_times_d(k, d, m):
    assert codecs.build(f"topk:k={k}").count(d) == m == codecs.build(f"randk:k={k}").count(d)


def test_topk_with_k_one_is_lossless():
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))
    _, y = round_trip("topk:k=1", x)
    assert bits(y) == bits(x)


@SETTINGS
@given(rows(st.floats(-2.0**100, 2.0**100, width=32)), st.floats(1e-3, 1.0), st.integers(0, 2**31))
def test_randk_sends_the_drawn_values_scaled_by_d_over_m(x, k, seed):
    codec = codecs.build(f"randk:k={k}")
    d = x.numel()
    enc = codec.encode(x, (seed, 1, "n"))
    y = codec.decode(enc, d)
    idx = torch.from_numpy(enc["idx"]).long()
    m = codec.count(d)
    assert idx.numel() == m and bool((idx[1:] > idx[:-1]).all()) and 0 <= int(idx.min()) and int(idx.max()) < d
    assert bits(torch.from_numpy(enc["val"])) == bits(x[idx])
    assert bits(y[idx]) == bits((x[idx].double() * (d / m)).float())
    rest = torch.ones(d, dtype=torch.bool)
    rest[idx] = False
    assert bool((y[rest] == 0).all())


def test_randk_same_key_same_bits_other_key_other_coordinates():
    codec = codecs.build("randk:k=0.05")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    a, b = codec.encode(x, KEY), codec.encode(x, KEY)
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)
    assert bits(codec.decode(a, 1000)) == bits(codec.decode(b, 1000))
    others = [codec.encode(x, (7, 3, node))["idx"] for node in ("node-b", "node-c")]
    others.append(codec.encode(x, (7, 4, "node-a"))["idx"])
    assert all(not np.array_equal(a["idx"], o) for o in others)


def test_randk_is_unbiased():
    d, codec = 40, codecs.build("randk:k=0.1")  # m = 4, gain 10
    x = torch.randn(d, generator=torch.Generator().manual_seed(2))
    N = 3000
    decoded = torch.stack([codec.decode(codec.encode(x, (0, r, "n")), d) for r in range(N)])
    drawn = (decoded != 0).double().mean(0)  # each coordinate drawn with probability m/d
    assert float((drawn - 0.1).abs().max()) < 0.04
    mean = decoded.double().mean(0)
    # E[C(x)] = x with variance (d/m - 1) x_j^2 / N per coordinate: relative error ~ sqrt(9/3000) = 0.055
    assert float((mean - x.double()).norm() / x.double().norm()) < 0.12
    topk = codecs.build("topk:k=0.1")
    assert float((topk.decode(topk.encode(x), d).double() - x.double()).norm() / x.double().norm()) > 0.3


@pytest.mark.parametrize("spec", SPECS)
def test_encoding_is_deterministic_and_decode_does_not_alias_it(spec):
    codec = codecs.build(spec)
    x = torch.randn(777, generator=torch.Generator().manual_seed(3))
    a, b = codec.encode(x, KEY), codec.encode(x.clone(), KEY)
    assert sorted(a) == sorted(b) and all(a[n].tobytes() == b[n].tobytes() for n in a)
    y = codec.decode(a, 777)
    before = bits(y)
    for arr in a.values():
        arr[...] = 0
    assert bits(y) == before  # the decoded row owns its memory
    x.zero_()
    assert any(arr.any() for arr in b.values())  # and the encoding does not view the row


@pytest.mark.parametrize("spec", SPECS)
def test_encoding_survives_a_flower_array_record(spec):
    from flwr.app import Array, ArrayRecord

    codec = codecs.build(spec)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    enc = codec.encode(x, KEY)
    record = ArrayRecord({name: Array(a) for name, a in enc.items()})
    received = {name: record[name].numpy() for name in record}
    received = {n: np.frombuffer(a.tobytes(), dtype=a.dtype) for n, a in received.items()}  # read-only, as on the wire
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bits(codec.decode(received, 1000)) == bits(codec.decode(enc, 1000))


# ---------------------------------------------------------------- scaled sign


@SETTINGS
@given(rows(), st.sampled_from([1, 3, 8, 128, 1000]))
def test_sign_sends_each_sign_and_the_mean_magnitude_of_each_block(x, block):
    enc, y = round_trip(f"sign:block={block}", x)
    d = x.numel()
    assert enc["bits"].dtype == np.uint8 and enc["bits"].shape == (math.ceil(d / 8),)
    assert enc["scale"].dtype == np.float32 and enc["scale"].shape == (math.ceil(d / block),)
    assert np.array_equal(np.unpackbits(enc["bits"], count=d), (x >= 0).numpy().astype(np.uint8))
    assert not np.unpackbits(enc["bits"])[d:].any()  # padding bits are 0
    for b in range(math.ceil(d / block)):
        part = x[b * block:(b + 1) * block].double()
        exact = math.fsum(abs(v) for v in part.tolist()) / len(part)  # the mean, to float64 rounding
        scale = float(enc["scale"][b])
        # the float32 nearest the mean (a float64 sum in another order may land across a float32
        # midpoint, so the bound carries float64's own rounding of the sum)
        assert abs(scale - exact) <= 0.5 * float(np.spacing(np.float32(exact))) + abs(exact) * len(part) * 2.0**-52
        sign = torch.where(part >= 0, 1.0, -1.0)
        assert bits(y[b * block:(b + 1) * block]) == bits((sign * scale).float())  # decoded from the scale sent


def test_sign_scale_minimises_the_error_and_contracts():
    """s = mean |x| minimises ||x - s sign(x)||^2 = ||x||^2 - ||x||_1^2 / n <= (1 - 1/n) ||x||^2."""
    x = torch.randn(128, generator=torch.Generator().manual_seed(8)) ** 3
    codec = codecs.build("sign:block=128")
    y = codec.decode(codec.encode(x), 128).double()
    err = float((x.double() - y).pow(2).sum())
    assert err == pytest.approx(float(x.double().pow(2).sum() - x.double().abs().sum() ** 2 / 128), rel=1e-5)
    assert err <= (1 - 1 / 128) * float(x.double().pow(2).sum())
    for s in (0.9, 1.1):
        assert float((x.double() - s * y).pow(2).sum()) > err
    assert bits(codec.decode(codec.encode(torch.zeros(5)), 5)) == bits(torch.zeros(5))  # 0 -> +0 scale


def test_sign_does_not_depend_on_the_key():
    codec = codecs.build("sign")
    x = torch.randn(300, generator=torch.Generator().manual_seed(9))
    a, b = codec.encode(x, KEY), codec.encode(x, (8, 4, "node-b"))
    assert all(a[n].tobytes() == b[n].tobytes() for n in a) and codec.encode(x).keys() == a.keys()


def test_shared_sign_sends_every_node_of_a_task_on_its_coordinates_and_a_stored_reply_decodes_alone():
    codec, d = codecs.build("shared-sign:share=0.25"), 1000
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(10))
    encs = [codec.encode(x[i], (7, 3, f"node-{i}")) for i in range(3)]
    sent = [codec.decode(enc, d) != 0 for enc in encs]  # decoded with the claim alone, no key
    assert all(torch.equal(s, sent[0]) for s in sent) and int(sent[0].sum()) == 250
    other = codec.decode(codec.encode(x[0], (7, 4, "node-0")), d) != 0
    assert int((other & sent[0]).sum()) < 125  # the next task's support is another draw (about 62 shared)
    where = sent[0].nonzero().flatten()
    dense = codecs.build("sign").encode(x[0][where], KEY)  # on those coordinates: sign's own bits and scales
    assert all(dense[n].tobytes() == encs[0][n].tobytes() for n in dense)
    assert bits(codecs.build("shared-sign:share=1").decode(codecs.build("shared-sign:share=1").encode(x[0], KEY), d)) \
        == bits(codecs.build("sign").decode(codecs.build("sign").encode(x[0], KEY), d))
    with pytest.raises(ValueError, match="shared-sign sends the coordinates its task announces"):
        codec.encode(x[0])


def test_a_reply_on_another_tasks_support_is_refused_with_the_reason():
    codec = codecs.build("shared-sign")
    enc = codec.encode(torch.randn(500, generator=torch.Generator().manual_seed(11)), (7, 3, "node-a"))
    assert codec.refusal(enc, (7, 3, "node-b")) is None  # any node of that task
    for key in ((7, 2, "node-a"), (8, 3, "node-a")):
        reason = codec.refusal(enc, key)
        assert "encoded on another task's support" in reason and f"task {key[1]}'s is" in reason
    assert codecs.build("sign").refusal(codecs.build("sign").encode(torch.ones(9)), (7, 2, "x")) is None


@pytest.mark.parametrize("d", [1, 7, 9, 1003])
def test_sign_refuses_padding_bits(d):
    codec = codecs.build("sign")
    enc = codec.encode(torch.randn(d, generator=torch.Generator().manual_seed(d)))
    enc["bits"] = enc["bits"].copy()
    enc["bits"][-1] |= 1  # the last bit of the last byte: padding, as d % 8 != 0
    with pytest.raises(ValueError, match=f"sign array 'bits' sets padding bits beyond coordinate {d}: they must be 0"):
        codec.decode(enc, d)


def test_sign_with_error_feedback_tracks_the_sum_of_the_rows():
    """EF-signSGD: what the coordinator has received after T rounds is the rows' sum up to one
    residual, which stays bounded (the scaled sign is a contraction)."""
    codec = codecs.build("sign:block=16")
    gen = torch.Generator().manual_seed(10)
    drift = torch.randn(64, generator=gen)
    residual, sent, total = None, torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)
    for _ in range(200):
        row = drift + 0.5 * torch.randn(64, generator=gen)
        enc, residual = codecs.error_feedback(codec, row, residual)
        sent += codec.decode(enc, 64).double()
        total += row.double()
        assert float(residual.norm()) < 20 * float(drift.norm())
    assert float((sent - total).norm() / total.norm()) < 0.05


# ---------------------------------------------------------------- bytes on the wire


@pytest.mark.parametrize("d", [10_000, 100_000])
def test_bytes_on_the_wire(d):
    x = torch.randn(d, generator=torch.Generator().manual_seed(5))
    sizes = {}
    for spec in SPECS:
        codec = codecs.build(spec)
        enc = codec.encode(x, KEY)
        sizes[spec] = codecs.nbytes(enc)
        assert sizes[spec] == codec.nbytes(d) and codec.ratio(d) == pytest.approx(4 * d / sizes[spec])
    assert sizes["none"] == 4 * d and sizes["fp16"] == 2 * d
    assert sizes["int8"] == d + 4 * math.ceil(d / 256) and 4 * d / sizes["int8"] >= 3.9
    assert sizes["topk:k=0.01"] == sizes["randk:k=0.01"] == 8 * math.ceil(0.01 * d)  # 50x fewer
    assert 4 * d / sizes["topk:k=0.01"] == 50
    assert sizes["sign"] == math.ceil(d / 8) + 4 * math.ceil(d / 128) and 4 * d / sizes["sign"] > 25
    m = d // 4  # share=0.25 of the coordinates, and the 8-byte claim of the support
    assert sizes["shared-sign"] == math.ceil(m / 8) + 4 * math.ceil(m / 128) + 8 and 4 * d / sizes["shared-sign"] > 99


# ---------------------------------------------------------------- error feedback


@SETTINGS
@given(st.integers(1, 60), st.integers(1, 8),
       st.sampled_from(["topk:k=0.1", "topk:k=0.5", "int8:block=4", "fp16", "sign:block=1", "sign:block=7",
                        "shared-sign:share=0.3,block=7"]),
       st.integers(0, 2**31))
def test_error_feedback_loses_nothing(d, T, spec, seed):
    """sum_t decoded_t + e_T = sum_t x_t, up to float32 rounding of the additions."""
    codec = codecs.build(spec)
    xs = torch.randn(T, d, generator=torch.Generator().manual_seed(seed)) * 10
    residual, sent = None, torch.zeros(d, dtype=torch.float64)
    for t in range(T):
        enc, residual = codecs.error_feedback(codec, xs[t], residual, KEY)
        sent += codec.decode(enc, d).double()
    total = xs.double().sum(0)
    assert torch.allclose(sent + residual.double(), total, rtol=0, atol=1e-5 * T * float(xs.abs().max()))


def test_error_feedback_makes_topk_converge_where_it_stalls_without():
    """Two nodes, one-row least squares each: f_i(w) = (v_i . (w - w*))^2 / 2 with v = (3, +-1).
    From w = 0 each node's largest coordinate is the first, and they cancel: top-1 without
    memory never moves; with error feedback the second coordinate is sent once it has built up."""
    codec = codecs.build("topk:k=0.5")
    V, w_star = torch.tensor([[3.0, 1.0], [3.0, -1.0]]), torch.tensor([0.0, 1.0])
    ends = {}
    for memory in (False, True):
        w, residuals = torch.zeros(2), [None, None]
        for _ in range(300):
            sent = []
            for i, v in enumerate(V):
                row = -0.1 * v * (v @ (w - w_star))  # a delta row: -lr * gradient
                if memory:
                    enc, residuals[i] = codecs.error_feedback(codec, row, residuals[i])
                else:
                    enc = codec.encode(row)
                sent.append(codec.decode(enc, 2))
            w = w + torch.stack(sent).mean(0)
        ends[memory] = float((w - w_star).norm())
    assert ends[False] == 1.0  # stalled at w = 0
    assert ends[True] < 1e-4


def test_error_feedback_refuses_a_mismatched_residual():
    with pytest.raises(ValueError, match="residual must match the row"):
        codecs.error_feedback(codecs.build("topk"), torch.zeros(5), torch.zeros(4))


# ---------------------------------------------------------------- specs


def test_build_and_canonical_specs():
    assert codecs.names() == ["fp16", "int8", "none", "randk", "shared-sign", "sign", "topk"]
    assert codecs.build("int8").spec == "int8:block=256"
    assert codecs.build("topk").spec == "topk:k=0.01"
    assert codecs.build("randk:k=1").k == 1.0  # an int where a float is meant
    assert codecs.build("sign").spec == "sign:block=128"
    assert codecs.build("shared-sign").spec == "shared-sign:share=0.25,block=128"
    for spec in ["none", "fp16", "int8:block=64", "topk:k=0.05", "randk:k=0.2", "sign:block=64",
                 "shared-sign:share=0.5,block=64"]:
        assert codecs.build(spec).spec == spec and codecs.build(codecs.build(spec).spec).spec == spec
    assert codecs.build("topk").biased and not codecs.build("randk").biased and codecs.build("randk").keyed
    assert codecs.build("sign").biased and not codecs.build("sign").keyed
    assert codecs.build("shared-sign").biased and codecs.build("shared-sign").keyed


@pytest.mark.parametrize("spec, message", [
    ("zip", "unknown codec 'zip' in 'zip': choose from fp16, int8, none, randk, shared-sign, sign, topk"),
    ("topk:m=3", "topk: unknown key m (known: k)"),
    ("int8:k=0.1", "int8: unknown key k (known: block)"),
    ("int8:block=2.5", "int8: block must be an integer >= 1 (got block=2.5)"),
    ("topk:k=abc", "topk: k must be a number in (0, 1] (got k='abc')"),
    ("topk:k=0", "topk: k must be a number in (0, 1] (got k=0)"),
    ("randk:k=1.5", "randk: k must be a number in (0, 1]"),
    ("randk:k=-0.1", "randk: k must be a number in (0, 1]"),
    ("topk:k=nan", "topk: k must be a number in (0, 1]"),
    ("int8:block=0", "int8: block must be an integer >= 1 (got block=0)"),
    ("sign:block=0", "sign: block must be an integer >= 1 (got block=0)"),
    ("sign:block=1.5", "sign: block must be an integer >= 1 (got block=1.5)"),
    ("sign:k=0.01", "sign: unknown key k (known: block)"),
    ("shared-sign:share=0", "shared-sign: share must be a number in (0, 1] (got share=0)"),
    ("shared-sign:share=1.5", "shared-sign: share must be a number in (0, 1]"),
    ("int8+topk", "a codec spec names one codec"),
    ("", "empty spec"),
])
def test_spec_errors(spec, message):
    with pytest.raises(ValueError) as err:
        codecs.build(spec)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- encode refuses what it cannot carry


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("row, message", [
    (torch.tensor([1.0, float("nan")]), "NaN or Inf"),
    (torch.tensor([1.0, float("inf")]), "NaN or Inf"),
    (torch.ones(3, dtype=torch.float64), "float32 rows"),
    (torch.ones(2, 3), "shape (d,)"),
    (torch.ones(0), "d >= 1"),
])
def test_encode_refuses_rows_it_cannot_carry(spec, row, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        codecs.build(spec).encode(row, KEY)


def test_randk_needs_a_key():
    with pytest.raises(ValueError, match="randk draws its coordinates from a key"):
        codecs.build("randk").encode(torch.ones(10))
    with pytest.raises(ValueError, match="key must be a tuple"):
        codecs.build("randk").encode(torch.ones(10), key=[1, 2])


# ---------------------------------------------------------------- decode: the gate for untrusted input

D = 1000  # int8: 4 blocks of 256; topk/randk k=0.01: 10 entries; sign: 125 bytes, 8 blocks of 128


def good(spec: str) -> codecs.Encoded:
    return codecs.build(spec).encode(torch.randn(D, generator=torch.Generator().manual_seed(6)), KEY)


def huge(dtype: str) -> np.ndarray:
    """A 1e12-long array that takes no memory (a zero-stride view): it must be refused unread."""
    return np.broadcast_to(np.zeros(1, dtype=dtype), (10**12,))


def with_(spec, name, value):
    def make():
        enc = good(spec)
        enc[name] = value(enc[name]) if callable(value) else value
        return enc
    return make


def setting(spec, name, position, value):
    def change(a):
        a = a.copy()
        a[position] = value
        return a
    return with_(spec, name, change)


MALFORMED = [
    # shape of the message
    ("none", lambda: None, "is a NoneType, expected a dict"),
    ("none", lambda: [np.zeros(D, "<f4")], "is a list, expected a dict"),
    ("int8", lambda: {"q": good("int8")["q"]}, "missing ['scale']"),
    ("none", lambda: {**good("none"), "extra": np.zeros(1)}, "extra ['extra']"),
    ("topk:k=0.01", lambda: {**good("topk:k=0.01"), 7: np.zeros(1)}, "extra [7]"),
    ("none", with_("none", "x", lambda a: a.tolist()), "is a list, expected numpy.ndarray"),
    ("none", with_("none", "x", torch.from_numpy), "is a Tensor, expected numpy.ndarray"),
    # dtypes
    ("none", with_("none", "x", lambda a: a.astype(np.float64)), "holds float64, expected float32"),
    ("none", with_("none", "x", lambda a: a.astype(">f4")), "holds >f4"),
    ("none", with_("none", "x", lambda a: a.astype(object)), "holds object"),
    ("fp16", with_("fp16", "x", lambda a: a.astype(np.float32)), "holds float32, expected float16"),
    ("int8", with_("int8", "q", lambda a: a.astype(np.uint8)), "holds uint8, expected int8"),
    ("int8", with_("int8", "scale", lambda a: a.astype(np.float16)), "holds float16, expected float32"),
    ("topk:k=0.01", with_("topk:k=0.01", "idx", lambda a: a.astype(np.int64)), "holds int64, expected int32"),
    ("randk:k=0.01", with_("randk:k=0.01", "val", lambda a: a.astype(np.float64)), "holds float64"),
    # shapes and lengths
    ("none", with_("none", "x", lambda a: a[:-1]), "shape (999,), expected (1000,)"),
    ("none", with_("none", "x", lambda a: a.reshape(10, 100)), "shape (10, 100)"),
    ("none", with_("none", "x", lambda a: np.array(1.0, np.float32)), "shape ()"),
    ("fp16", with_("fp16", "x", lambda a: np.concatenate([a, a])), "shape (2000,)"),
    ("int8", with_("int8", "q", lambda a: a[:-1]), "'q' has shape (999,)"),
    ("int8", with_("int8", "scale", lambda a: np.concatenate([a, a[:1]])), "'scale' has shape (5,), expected (4,)"),
    ("int8", with_("int8", "scale", lambda a: a[:3]), "'scale' has shape (3,), expected (4,)"),
    ("topk:k=0.01", with_("topk:k=0.01", "idx", lambda a: np.arange(11, dtype="<i4")), "'idx' has shape (11,), expected (10,)"),
    ("topk:k=0.01", lambda: {"idx": np.arange(11, dtype="<i4"), "val": np.ones(11, "<f4")}, "expected (10,)"),
    ("randk:k=0.01", lambda: {"idx": np.arange(9, dtype="<i4"), "val": np.ones(9, "<f4")}, "expected (10,)"),
    # claims of a huge length
    ("none", with_("none", "x", huge("<f4")), "shape (1000000000000,)"),
    ("fp16", with_("fp16", "x", huge("<f2")), "shape (1000000000000,)"),
    ("int8", with_("int8", "q", huge("i1")), "shape (1000000000000,)"),
    ("int8", with_("int8", "scale", huge("<f4")), "shape (1000000000000,)"),
    ("topk:k=0.01", lambda: {"idx": huge("<i4"), "val": huge("<f4")}, "shape (1000000000000,)"),
    ("randk:k=0.01", with_("randk:k=0.01", "val", huge("<f4")), "shape (1000000000000,)"),
    # values
    ("none", setting("none", "x", 5, np.nan), "'x' holds NaN or Inf"),
    ("none", setting("none", "x", 0, -np.inf), "'x' holds NaN or Inf"),
    ("fp16", setting("fp16", "x", 3, np.inf), "'x' holds NaN or Inf"),
    ("fp16", setting("fp16", "x", 3, np.nan), "'x' holds NaN or Inf"),
    ("int8", setting("int8", "scale", 1, np.nan), "'scale' holds NaN or Inf"),
    ("int8", setting("int8", "scale", 1, np.inf), "'scale' holds NaN or Inf"),
    ("int8", setting("int8", "scale", 2, -0.5), "'scale' holds negative values"),
    ("int8", setting("int8", "q", 9, -128), "'q' holds -128"),
    ("int8", lambda: {"q": np.full(D, 127, "i1"), "scale": np.full(4, 3e38, "<f4")}, "decodes to non-finite"),
    ("topk:k=0.01", setting("topk:k=0.01", "val", 0, np.nan), "'val' holds NaN or Inf"),
    ("topk:k=0.01", setting("topk:k=0.01", "idx", -1, D), "outside [0, 1000)"),
    ("topk:k=0.01", setting("topk:k=0.01", "idx", 0, -1), "outside [0, 1000)"),
    ("topk:k=0.01", setting("topk:k=0.01", "idx", 0, 2**31 - 1), "outside [0, 1000)"),
    ("topk:k=0.01", with_("topk:k=0.01", "idx", lambda a: a[::-1].copy()), "not sorted ascending"),
    ("topk:k=0.01", with_("topk:k=0.01", "idx", lambda a: np.sort(np.r_[a[:-1], a[:1]]).astype("<i4")), "repeats an index"),
    ("randk:k=0.01", setting("randk:k=0.01", "val", 4, -np.inf), "'val' holds NaN or Inf"),
    ("randk:k=0.01", setting("randk:k=0.01", "idx", 0, D + 5), "outside [0, 1000)"),
    ("randk:k=0.01", setting("randk:k=0.01", "val", 0, 3e38), "decodes to non-finite"),  # x d/m overflows
    ("sign", lambda: {"bits": good("sign")["bits"]}, "missing ['scale']"),
    ("sign", with_("sign", "bits", lambda a: a.astype(np.int8)), "holds int8, expected uint8"),
    ("sign", with_("sign", "scale", lambda a: a.astype(np.float64)), "holds float64, expected float32"),
    ("sign", with_("sign", "bits", lambda a: a[:-1]), "'bits' has shape (124,), expected (125,)"),
    ("sign", with_("sign", "scale", lambda a: a[:7]), "'scale' has shape (7,), expected (8,)"),
    ("sign", with_("sign", "bits", huge("u1")), "shape (1000000000000,)"),
    ("sign", setting("sign", "scale", 3, np.nan), "'scale' holds NaN or Inf"),
    ("sign", setting("sign", "scale", 0, np.inf), "'scale' holds NaN or Inf"),
    ("sign", setting("sign", "scale", 7, -1.0), "'scale' holds negative values"),
    # shared-sign: 250 of the 1000 coordinates, 32 bytes of bits, 2 scales, the claim of the support
    ("shared-sign", lambda: {k: v for k, v in good("shared-sign").items() if k != "support"}, "missing ['support']"),
    ("shared-sign", with_("shared-sign", "support", lambda a: a.astype(np.int32)), "holds int32, expected int64"),
    ("shared-sign", with_("shared-sign", "support", lambda a: np.r_[a, a]), "'support' has shape (2,), expected (1,)"),
    ("shared-sign", with_("shared-sign", "bits", lambda a: a[:-1]), "'bits' has shape (31,), expected (32,)"),
    ("shared-sign", setting("shared-sign", "support", 0, -1), "claims the seed -1, outside [0, 2**63)"),
    ("shared-sign", setting("shared-sign", "scale", 1, -1.0), "'scale' holds negative values"),
    ("shared-sign", setting("shared-sign", "scale", 0, np.nan), "'scale' holds NaN or Inf"),
]


@pytest.mark.parametrize("spec, make, message", MALFORMED, ids=[f"{s}-{m[:30]}" for s, _, m in MALFORMED])
def test_decode_rejects_malformed_input_with_a_reason(spec, make, message):
    enc = make()
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no overflow or cast warnings either
            with pytest.raises(ValueError) as err:
                codecs.build(spec).decode(enc, D)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    reason = str(err.value)
    assert message in reason and "\n" not in reason and len(reason) < 300
    assert reason.startswith(spec.split(":")[0] + " ")
    assert peak < 1_000_000  # never more than a few copies of this small row, whatever the claim


@pytest.mark.parametrize("d", [0, -1, True, 2.0])
def test_decode_refuses_a_bad_d(d):
    with pytest.raises(ValueError, match="d >= 1"):
        codecs.build("none").decode({"x": np.zeros(1, "<f4")}, d)


def test_sparse_codecs_refuse_rows_beyond_int32_indices():
    with pytest.raises(ValueError, match="int32 indices"):
        codecs.build("topk").decode({"idx": np.zeros(1, "<i4"), "val": np.zeros(1, "<f4")}, 2**31)


DTYPES = st.sampled_from(["<f4", "<f2", "i1", "<i4", "<f8", ">f4", "u1", "<i8"])


@st.composite
def untrusted(draw, spec: str, d: int):
    """What a Byzantine node might send: mostly the right names, dtypes and lengths (so the
    value checks are reached), with arbitrary values; sometimes anything at all."""
    layout = codecs.build(spec).layout(d)
    enc = {}
    for name, (dtype, length) in layout.items():
        if draw(st.booleans()) or draw(st.booleans()):
            dt, n = dtype, length
        else:
            dt, n = draw(DTYPES), draw(st.integers(0, 2 * length + 2))
        if draw(st.integers(0, 20)) == 0:
            continue  # a missing array
        enc[name] = draw(hnp.arrays(np.dtype(dt), n))
    if draw(st.integers(0, 20)) == 0:
        enc["junk"] = np.zeros(1)
    return enc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["none", "fp16", "int8:block=4", "topk:k=0.2", "randk:k=0.3", "sign:block=4"]),
       st.integers(1, 30))
def test_decode_either_gives_a_finite_row_or_a_reason(data, spec, d):
    enc = data.draw(untrusted(spec, d))
    codec = codecs.build(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            row = codec.decode(enc, d)
        except ValueError as err:
            assert str(err) and "\n" not in str(err)
            return
    assert row.dtype == torch.float32 and row.shape == (d,) and bool(torch.isfinite(row).all())
