"""The subtle attackers: poisoned-fl, cc-orthogonal, drift. Their formulas on small inputs,
their memory across rounds, and their effect through the bench."""

import pytest
import torch
from torch.func import functional_call

import aggregators
import attacks
from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import CellRun, run_cell
from evaluation.bench.scenario import grid, load_scenario
from evaluation.bench.threat import ThreatModel
from nodes.engine.engine import Engine
from nodes.settings import Settings
from robust.models import build_model
from robust.params import unflatten

F64 = torch.float64
LAYOUT = [("0.weight", (3, 2)), ("0.bias", (3,))]  # a 2-feature, 3-class logistic regression: d = 9
TINY = ["dataset=digits", "model=mlp", "nodes=10", "byzantine=2", "seeds=[0]"]


def ctx(n: int = 10, seed: int = 0, **kw) -> attacks.Context:
    return attacks.Context(n=n, generator=torch.Generator().manual_seed(seed), **kw)


def honest(h: int = 8, d: int = 9, seed: int = 1, dtype=F64) -> torch.Tensor:
    return 0.3 + torch.randn(h, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("spec, kw", [
    ("poisoned-fl", {}),
    ("cc-orthogonal:tau=2", {}),
    ("drift:eps=0.1,target=2", {"layout": LAYOUT, "step_sign": 1}),
])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_rows_have_the_shape_and_dtype_and_are_seeded(spec, kw, dtype):
    H = honest(dtype=dtype)
    a = attacks.build(spec, 2)(H, ctx(**kw))
    assert a.shape == (2, 9) and a.dtype == dtype and torch.isfinite(a).all()
    assert torch.equal(a, attacks.build(spec, 2)(H, ctx(**kw)))  # same seed, same rows


@pytest.mark.parametrize("spec, words", [
    ("poisoned-fl:scale=0", "poisoned-fl: scale must be a number > 0"),
    ("poisoned-fl:period=0", "poisoned-fl: period must be an integer >= 1"),
    ("poisoned-fl:decay=1", r"poisoned-fl: decay must be a number in \(0, 1\)"),
    ("poisoned-fl:floor=3", r"poisoned-fl: floor must be <= scale \(got floor=3.0, scale=0.5\)"),
    ("cc-orthogonal:tau=0", "cc-orthogonal: tau must be a number > 0"),
    ("cc-orthogonal:radius=1.5", r"cc-orthogonal: radius must be a number in \(0, 1\]"),
    ("cc-orthogonal:angle=200", r"cc-orthogonal: angle must be a number in \[0, 180\]"),
    ("cc-orthogonal:lam=-0.1", r"cc-orthogonal: lam must be a number in \[0, 1\]"),
    ("drift:eps=0", "drift: eps must be a number > 0"),
    ("drift:target=-1", "drift: target must be an integer >= 0"),
])
def test_parameters_are_validated_in_one_line(spec, words):
    with pytest.raises(ValueError, match=words):
        attacks.build(spec, 1)


def test_poisoned_fl_keeps_one_sign_vector_and_scales_by_the_last_aggregate():
    attack = attacks.build("poisoned-fl:scale=3", 2)
    H = honest()
    first = attack(H, ctx(seed=5))
    s = attack.sign
    assert set(s.tolist()) == {-1.0, 1.0}
    assert torch.allclose(first[0].norm(), 3 * H.mean(dim=0).norm())  # no aggregate yet: the honest mean's
    assert torch.equal(torch.sign(first[0]), s) and torch.equal(first[0], first[1])
    for t, seed in ((2, 6), (3, 7)):
        previous = torch.randn(9, generator=torch.Generator().manual_seed(t), dtype=F64)
        rows = attack(honest(seed=t), ctx(seed=seed, previous=previous, round=t))
        assert torch.equal(attack.sign, s)  # fixed for the run, whatever the round's generator
        assert torch.equal(torch.sign(rows[0])[rows[0] != 0], s[rows[0] != 0])
        assert torch.allclose(rows[0].norm(), 3 * previous.norm())
        # r = a - ||a|| g_{t-1}/||g_{t-1}||: the magnitudes follow the last move, own push removed
        r = previous - previous.norm() * first[0] / first[0].norm()
        assert torch.allclose(rows[0], 3 * previous.norm() * s * r.abs() / r.norm())
        first = rows
    # with an aggregate, the honest rows give the shape only
    again = attacks.build("poisoned-fl", 1)
    prev = torch.ones(9, dtype=F64)
    assert torch.equal(again(H, ctx(previous=prev)), attacks.build("poisoned-fl", 1)(5 * H - 2, ctx(previous=prev)))


def test_poisoned_fl_shrinks_its_scale_when_the_model_does_not_follow_the_signs():
    d = 400
    attack = attacks.build("poisoned-fl:scale=2,period=2,decay=0.5,floor=0.6", 1)
    H = honest(d=d)
    attack(H, ctx())
    s = attack.sign
    for _ in range(4):  # two periods of aggregates along s: the attack works, the scale stays
        attack(H, ctx(previous=s.clone()))
    assert attack.c == 2.0
    noise = torch.randn(d, generator=torch.Generator().manual_seed(9), dtype=F64)
    attack(H, ctx(previous=noise))
    assert attack.c == 2.0  # mid-period: no check yet
    attack(H, ctx(previous=-s))
    assert attack.c == 1.0  # the period's sum disagrees with s: c <- decay c
    for _ in range(2):
        attack(H, ctx(previous=-s))
    assert attack.c == 1.0  # 0.5 would fall below the floor 0.6: it stays


def cc_after(center: torch.Tensor, X: torch.Tensor, tau: float) -> torch.Tensor:
    rule = aggregators.build(f"centered-clipping:tau={tau}", 2)
    rule.rule.load_state({"center": center})
    return rule(X)


def test_cc_orthogonal_rows_sit_inside_the_radius_orthogonal_to_the_reference():
    H = honest(h=8, d=30)
    mean = H.mean(dim=0)
    previous = mean + 0.2 * torch.randn(30, generator=torch.Generator().manual_seed(2), dtype=F64)
    rows = attacks.build("cc-orthogonal:tau=2,radius=0.9", 2)(H, ctx(previous=previous))
    step = rows[0] - previous
    assert float(step.norm()) == pytest.approx(1.8)  # radius * tau from CC's center: never clipped
    ref = 0.9 * previous + 0.1 * mean  # lam = 0.9
    assert float(step @ ref) == pytest.approx(0.0, abs=1e-9)
    assert float(step.sum()) > 0  # along the all-ones vector's orthogonal part, the same every round
    # lam=0: orthogonal to the honest mean itself
    step0 = attacks.build("cc-orthogonal:tau=2,lam=0", 2)(H, ctx(previous=previous))[0] - previous
    assert float(step0 @ mean) == pytest.approx(0.0, abs=1e-9) and float(step0.norm()) == pytest.approx(1.98)
    # angle 180: straight back along the reference
    back = attacks.build("cc-orthogonal:tau=2,angle=180,lam=1", 2)(H, ctx(previous=previous))[0] - previous
    assert torch.allclose(back, -1.98 * previous / previous.norm())
    # the first round: CC's center is zero, the reference the honest mean
    first = attacks.build("cc-orthogonal:tau=2", 2)(H, ctx())[0]
    assert float(first.norm()) == pytest.approx(1.98) and float(first @ mean) == pytest.approx(0.0, abs=1e-9)


def test_cc_orthogonal_moves_cc_by_its_whole_radius_every_round():
    # honest rows within tau of the center: CC is the plain mean of all rows, the Byzantine
    # ones included at full length, so the aggregate moves (f/n) radius tau sideways
    H = honest(h=8, d=30) * 0.05
    center = H.mean(dim=0)
    rows = attacks.build("cc-orthogonal:tau=2", 2)(H, ctx(previous=center))
    X = torch.cat([H, rows])
    out = cc_after(center, X, 2.0)
    assert torch.allclose(out, X.mean(dim=0))
    assert float((out - center).norm()) == pytest.approx(2 / 10 * 1.98, rel=1e-6)
    flip = -H.mean(dim=0).expand(2, -1)  # sign-flip: also unclipped here, but it moves CC less
    assert float((cc_after(center, torch.cat([H, flip]), 2.0) - center).norm()) < 0.5 * float((out - center).norm())


def test_drift_nudges_the_target_bias_the_same_way_every_round():
    attack = attacks.build("drift:eps=0.1,target=1", 2)
    nudges = []
    for t, sign in ((1, 1), (2, 1), (3, -1)):
        H = honest(seed=t)
        rows = attack(H, ctx(layout=LAYOUT, step_sign=sign, round=t))
        nudge = rows[0] - H.mean(dim=0)
        assert torch.equal(rows[0], rows[1])
        assert float(nudge[7]) == pytest.approx(sign * 0.1 * float(H.norm(dim=1).median()))
        assert torch.count_nonzero(nudge) == 1  # the 3-class bias' entry 1 is coordinate 6 + 1
        nudges.append(nudge / nudge.norm())
    assert torch.equal(nudges[0], nudges[1]) and torch.equal(nudges[0], -nudges[2])


def test_drift_refuses_without_a_usable_layout():
    H = honest()
    drift = attacks.build("drift", 2)
    with pytest.raises(ValueError, match="pass Context.layout and Context.step_sign"):
        drift(H, ctx())
    with pytest.raises(ValueError, match="drift target=3 but the output layer has 3 classes: lower target"):
        attacks.build("drift:target=3", 1)(H, ctx(layout=LAYOUT, step_sign=1))
    with pytest.raises(ValueError, match=r"last parameter to be the output layer's bias \(got '0.weight'"):
        drift(H, ctx(layout=[("0.bias", (3,)), ("0.weight", (3, 2))], step_sign=1))
    with pytest.raises(ValueError, match="layout describes 8 values, the rows have 9"):
        drift(H, ctx(layout=[("0.weight", (5,)), ("0.bias", (3,))], step_sign=1))


@pytest.mark.parametrize("protocol, sign", [("delta", 1), ("momentum", -1), ("delta:server_momentum=0.9", 1)])
def test_the_threat_model_tells_attacks_the_layout_and_the_step_sign(protocol, sign):
    model = build_model("mlp", (4,), 3)
    engine = Engine(Settings(aggregator="mean", tolerate=1, protocol=protocol), model,
                    torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64))
    assert ThreatModel.layout(engine) == [("1.weight", (64, 4)), ("1.bias", (64,)), ("3.weight", (3, 64)),
                                          ("3.bias", (3,))]
    assert ThreatModel.step_sign(engine) == sign


def mean_kappa(aggregator: str, attack: str, config: dict) -> float:
    record = run_cell(Cell(config, aggregator, attack, 0))
    return sum(k for k in record["kappa"] if k == k) / len(record["kappa"])


def test_cc_orthogonal_gets_through_centered_clipping_where_sign_flip_does_not():
    # nothing is quarantined here (no flags, no evidence): the comparison is of the rules alone. CC shrinks the
    # sign-flip's pull (its rows are farther than tau) but lets cc-orthogonal's whole push in,
    # more than plain averaging of the same rows does
    cfg = grid(load_scenario(None, TINY + ["rounds=10", "quarantine-after=1000", "false-alarm=0"]))[0]
    cc, attack = "centered-clipping:tau=1", "cc-orthogonal:tau=1"
    orthogonal_cc, orthogonal_mean = mean_kappa(cc, attack, cfg), mean_kappa("mean", attack, cfg)
    flip_cc, flip_mean = mean_kappa(cc, "sign-flip", cfg), mean_kappa("mean", "sign-flip", cfg)
    assert flip_cc < 0.9 * flip_mean
    assert orthogonal_cc > 1.1 * orthogonal_mean
    assert orthogonal_cc > flip_cc


def target_share(attack: str, config: dict) -> float:
    """The share of test samples predicted as class 0, averaged over the rounds."""
    run = CellRun(Cell(config, "mean", attack, 0))
    shares = []
    while not run.engine.done:
        run.play_round()
        model = run.engine.model
        with torch.no_grad():
            logits = functional_call(model, unflatten(run.engine.w, model), (run.setup.data.x_test,))
        shares.append(float((logits.argmax(dim=1) == 0).double().mean()))
    return sum(shares) / len(shares)


def test_drift_raises_the_predicted_share_of_its_target():
    cfg = grid(load_scenario(None, TINY + ["rounds=8", "protocol=momentum"]))[0]
    clean, drifted = target_share("none", cfg), target_share("drift:eps=0.5,target=0", cfg)
    assert drifted > clean + 0.02
