"""evade: the rows sent stay under every chosen detector's threshold, at the largest strength
the bisection can tell, seeded; and in a bench cell it damages mean while staying hidden."""

import math

import pytest
import torch

import attacks
from attacks.base import honest_std, unit
from attacks.evade import DIRECTIONS, bend, grad_rows
from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import CellRun, run_cell
from evaluation.reports.metrics import roc_auc
from evaluation.bench.scenario import grid, load_scenario
from nodes.engine.detectors import DETECTORS, score_round
from nodes.engine.flags import FlagPolicy

F64 = torch.float64
F, RATIO, MAX, STEPS, Q = 3, 1.5, 10.0, 12, 0.95
TARGETS = tuple(d for d in DETECTORS if d not in ("discarded", "loss-score"))  # what evade:detector=all hides from (the
# loss score needs the coordinator's root set and model: the bench's Context adds it where the engine holds them)
EARLIER = {"dir": "alie", "jitter": "gauss", "quantile": "0.95", "auc": "1"}  # the defaults before the strongest


def old(spec: str) -> str:
    """``spec`` with evade's earlier defaults for what it leaves out: these tests pin the mechanics
    (bisection, quantiles, the Gaussian jitter) that the earlier defaults exercised."""
    given = {item.split("=")[0] for item in spec.split(":", 1)[1].split(",")}
    return ",".join([spec, *(f"{k}={v}" for k, v in EARLIER.items() if k not in given)])


def test_its_defaults_are_its_strongest_measured_setting():
    attack = attacks.build("evade:detector=all", F)
    got = (attack.dir, attack.jitter, attack.auc, attack.quantile, attack.policy)
    assert got == ("grad", "typical", 0.7, 1.0, True)
    assert old("evade:detector=all,dir=sign") == "evade:detector=all,dir=sign,jitter=gauss,quantile=0.95,auc=1"


def honest_rows(h: int = 12, d: int = 400, seed: int = 0) -> torch.Tensor:
    """Honest-looking rows: a shared mean, a low-rank common part and row-specific noise levels
    (so that the honest scores spread and there is room to hide in)."""
    g = torch.Generator().manual_seed(seed)
    mu = 0.5 * torch.randn(d, generator=g, dtype=F64)
    scale = torch.linspace(0.6, 1.4, h, dtype=F64)[:, None]
    low = torch.randn(h, 3, generator=g, dtype=F64) @ torch.randn(3, d, generator=g, dtype=F64)
    return mu + scale * torch.randn(h, d, generator=g, dtype=F64) + 0.3 * low


H = honest_rows()
OWN = H[:F] + 0.01  # the colluders' own honest updates (sent when they lie low)


def policy(ratio: float):
    """The flag policy's per-round rule with ``ratio`` (as ``FlagPolicy.flags_rows``)."""
    return FlagPolicy(ratio, 3).flags_rows


def ctx(seed: int = 1, **kw) -> attacks.Context:
    kw = {"detectors": lambda X: score_round(X, F), "flagged": policy(RATIO), "own": OWN, **kw}
    return attacks.Context(n=H.shape[0] + F, generator=torch.Generator().manual_seed(seed), **kw)


def threshold(honest: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of ``honest`` by linear interpolation between order statistics."""
    s = sorted(honest.tolist())
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] + (pos - lo) * (s[min(lo + 1, len(s) - 1)] - s[lo])


def crossing(rows: torch.Tensor, detector: str, q: float = Q) -> list[str]:
    """The chosen detectors (and ``policy``) that flag one of ``rows`` next to ``H``."""
    h = H.shape[0]
    scores = score_round(torch.cat([H, rows]), F)
    names = TARGETS if detector == "all" else () if detector == "policy" else (detector,)
    out = [n for n in names if float(scores[n][h:].max()) > threshold(scores[n][:h], q)]
    if detector in ("policy", "all") and float(scores["distance-ratio"][h:].max()) > RATIO:
        out.append("policy")
    return out


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("detector", [*TARGETS, "policy", "all"])
def test_the_rows_sent_pass_and_one_bisection_step_more_crosses(detector, direction):
    attack = attacks.build(old(f"evade:detector={detector},dir={direction}"), F)
    rows = attack(H, ctx())
    s = attack.last_strength
    jitter = attack.jitter_rows(H, ctx())  # the same seeded draw the attack made
    row = DIRECTIONS[direction](H)
    if s is None:  # lying low: even strength 0 is flagged, so the colluders send their own updates
        assert torch.equal(rows, OWN)
        assert crossing(row(0.0) + jitter, detector)
        return
    assert torch.equal(rows, row(s) + jitter)  # the jitter is in the checked rows, not added after
    assert crossing(rows, detector) == []
    if direction == "sign":  # on these rows every sign search ends inside (0, max)
        assert 0 < s < MAX
    assert s == MAX or crossing(row(s + MAX / 2**STEPS) + jitter, detector)


def test_the_check_does_not_depend_on_where_the_rows_sit():
    attack = attacks.build(old("evade:detector=all,dir=sign"), F)
    rows = attack(H, ctx())
    order = torch.randperm(H.shape[0] + F, generator=torch.Generator().manual_seed(3))
    X = torch.cat([H, rows])[order]
    scores = score_round(X, F)
    byz = order >= H.shape[0]
    for name in TARGETS:
        assert float(scores[name][byz].max()) <= threshold(scores[name][~byz], Q)
    assert float(scores["distance-ratio"][byz].max()) <= RATIO


def test_a_lower_quantile_hides_deeper_and_pushes_less():
    deep = attacks.build(old("evade:detector=all,dir=sign,quantile=0.6"), F)
    rows = deep(H, ctx())
    assert crossing(rows, "all", q=0.6) == []
    loose = attacks.build(old("evade:detector=all,dir=sign"), F)
    loose(H, ctx())
    assert 0 < deep.last_strength < loose.last_strength


def test_the_policy_alone_is_the_flag_ratio():
    attack = attacks.build(old("evade:detector=policy,dir=alie"), F)
    attack(H, ctx())
    tight = attack.last_strength
    attack(H, ctx(flagged=policy(2 * RATIO)))
    assert 0 < tight < attack.last_strength  # a looser policy lets a stronger row through


def test_seeded_and_the_colluders_differ():
    attack = attacks.build(old("evade:detector=all,dir=sign"), F)
    a, b = attack(H, ctx()), attack(H, ctx())
    assert torch.equal(a, b)
    assert not torch.equal(a, attack(H, ctx(seed=2)))
    assert all(not torch.equal(a[i], a[j]) for i in range(F) for j in range(i + 1, F))
    spread = attacks.build(old("evade:detector=all,dir=sign,spread=0.5"), F)
    assert not torch.equal(spread(H, ctx()), a)


def test_parameter_errors():
    with pytest.raises(ValueError, match="evade: detector: discarded is the rule's choice, not a score"):
        attacks.build("evade:detector=discarded", 1)
    with pytest.raises(ValueError, match="evade detector must be one of distance-ratio, krum-score, .*policy, geometric or all \\(got detector='nope'"):
        attacks.build("evade:detector=nope", F)(H, ctx())  # checked against the deployment's detectors
    with pytest.raises(ValueError, match="evade: dir must be one of alie, ipm, sign, grad \\(got dir='up'\\)"):
        attacks.build("evade:dir=up", 1)
    with pytest.raises(ValueError, match="evade: jitter must be one of gauss, own, typical \\(got jitter='noise'\\)"):
        attacks.build("evade:jitter=noise", 1)
    for a in ("0", "1.5"):
        with pytest.raises(ValueError, match="evade: auc must be a number in \\(0, 1\\]"):
            attacks.build(f"evade:auc={a}", 1)
    with pytest.raises(ValueError, match="evade: steps must be an integer >= 1"):
        attacks.build("evade:steps=0", 1)
    with pytest.raises(ValueError, match="evade: max must be a number > 0"):
        attacks.build("evade:max=0", 1)
    for q in ("0", "1.5"):
        with pytest.raises(ValueError, match="evade: quantile must be a number in \\(0, 1\\]"):
            attacks.build(f"evade:quantile={q}", 1)
    with pytest.raises(ValueError, match="evade: steps must be an integer >= 1 \\(got steps=1.5\\)"):
        attacks.build("evade:steps=1.5", 1)


def test_what_the_context_must_carry():
    with pytest.raises(ValueError, match="evade detector=policy hides from the deployment's detectors and flag policy"):
        attacks.build(old("evade:detector=policy"), F)(H, ctx(flagged=None))
    with pytest.raises(ValueError, match="evade detector=norm hides from the deployment's detectors"):
        attacks.build(old("evade:detector=norm"), F)(H, ctx(detectors=None))
    with pytest.raises(ValueError, match="pass Context.own"):
        attacks.build(old("evade:detector=norm"), F)(H, ctx(own=None))
    rows = attacks.build(old("evade:detector=norm"), F)(H, ctx(flagged=None))  # a detector alone needs no policy
    assert rows.shape == (F, H.shape[1])


BEFORE = honest_rows(seed=7)  # the previous round's honest rows (dir=grad remembers their mean)


def after_a_round(spec: str) -> attacks.Attack:
    """The attack of ``spec`` once it has crafted round 1 on ``BEFORE`` (the tests then play round 2 on ``H``)."""
    attack = attacks.build(spec, F)
    attack(BEFORE, ctx(round=1))
    return attack


def typical_bases(h: torch.Tensor) -> torch.Tensor:
    """The ``F`` rows of ``h`` whose highest rank over every detector's score of ``h`` is lowest."""
    scores = score_round(h, F)
    worst = [max(sorted(range(len(h)), key=lambda i: (float(scores[k][i]), i)).index(i) for k in scores)
             for i in range(len(h))]
    return h[sorted(range(len(h)), key=lambda i: (worst[i], i))[:F]]


def test_grad_pushes_orthogonally_to_the_honest_mean_toward_the_previous_one():
    row = grad_rows(H, BEFORE.mean(dim=0))
    mean, u = H.mean(dim=0), unit(H.mean(dim=0))
    push = row(0.7) - mean
    before = BEFORE.mean(dim=0)
    expected = unit(before - (before @ u) * u)
    assert torch.allclose(push, 0.7 * honest_std(H).norm() * expected)
    assert abs(float(push @ u)) < 1e-9 * float(push.norm())
    assert torch.equal(grad_rows(H, None)(5.0), mean)  # no previous round: no push


def test_grad_remembers_the_previous_round_only():
    attack = attacks.build(old("evade:detector=all,dir=grad,jitter=own"), F)
    first = attack(H, ctx(round=2))
    assert torch.allclose(first, OWN)  # no round 1 seen: no push, the colluders' own rows (to rounding)
    pushed = after_a_round(old("evade:detector=all,dir=grad,jitter=own"))
    a, b = pushed(H, ctx(round=2)), pushed(H, ctx(round=2))  # a call again in the same round
    assert torch.equal(a, b) and not torch.allclose(a, OWN) and pushed.last_strength > 0
    assert torch.equal(a, after_a_round(old("evade:detector=all,dir=grad,jitter=own"))(H, ctx(round=2)))  # seeded
    assert torch.allclose(pushed(H, ctx(round=4)), OWN)  # round 3 unseen: no push again


@pytest.mark.parametrize("jitter", ["own", "typical"])
def test_a_bent_row_keeps_its_distance_to_the_mean_and_its_part_along_it(jitter):
    attack = after_a_round(old(f"evade:detector=all,dir=grad,jitter={jitter},quantile=1"))
    H0 = H.clone()
    rows = attack(H, ctx(round=2))
    assert torch.equal(H, H0)  # the honest rows are not touched
    bases = OWN if jitter == "own" else typical_bases(H)
    mean, u = H.mean(dim=0), unit(H.mean(dim=0))
    assert attack.last_strength is not None and attack.last_strength > 0
    assert torch.allclose((rows - mean).norm(dim=1), (bases - mean).norm(dim=1))
    assert torch.allclose((rows - mean) @ u, (bases - mean) @ u)
    assert torch.allclose(rows.norm(dim=1), bases.norm(dim=1))


def test_bend_shrinks_the_rest_and_stops_at_zero():
    mean = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    D = torch.tensor([[0.5, 0.0, 2.0]], dtype=F64)
    row = bend(mean, D, torch.tensor([0.0, 1.2, 0.0], dtype=F64))
    assert torch.allclose(row, torch.tensor([[1.5, 1.2, 1.6]], dtype=F64))  # lam = 0.8: ||(1.2, 1.6)|| = 2
    row = bend(mean, D, torch.tensor([0.0, 3.0, 0.0], dtype=F64))  # longer than D: lam = 0
    assert torch.allclose(row, torch.tensor([[1.5, 3.0, 0.0]], dtype=F64))
    assert torch.equal(bend(mean, D, torch.zeros(3, dtype=F64)), mean + D)


@pytest.mark.parametrize("direction", [*DIRECTIONS, "grad"])
@pytest.mark.parametrize("jitter", ["own", "typical"])
def test_bent_rows_pass_the_auc_bound_and_one_step_more_does_not(direction, jitter):
    auc = 0.7
    attack = after_a_round(old(f"evade:detector=all,dir={direction},jitter={jitter},auc={auc},quantile=1"))
    rows = attack(H, ctx(round=2))
    s, h = attack.last_strength, H.shape[0]
    if s is None:
        assert torch.equal(rows, OWN)
        return
    mean = H.mean(dim=0)
    bases = OWN if jitter == "own" else typical_bases(H)
    row = grad_rows(H, BEFORE.mean(dim=0)) if direction == "grad" else DIRECTIONS[direction](H)
    sent = lambda t: bend(mean, bases - mean, row(t) - mean)  # noqa: E731
    assert torch.equal(rows, sent(s))
    byz = torch.arange(h + F) >= h

    def hidden(B: torch.Tensor) -> bool:
        scores = score_round(torch.cat([H, B]), F)
        return (not crossing(B, "all", q=1.0)
                and all(roc_auc(scores[name], byz) <= auc for name in TARGETS))

    assert hidden(rows)
    assert s == MAX or not hidden(sent(s + MAX / 2**STEPS))


def test_a_tighter_auc_pushes_less():
    tight = after_a_round(old("evade:detector=all,dir=grad,jitter=typical,auc=0.65,quantile=1"))
    tight(H, ctx(round=2))
    loose = after_a_round(old("evade:detector=all,dir=grad,jitter=typical,quantile=1"))
    loose(H, ctx(round=2))
    assert 0 < tight.last_strength < loose.last_strength


SMALL = ['aggregators=["mean"]', "nodes=10", "byzantine=2", "rounds=15", "seeds=[0]"]


def test_in_a_bench_cell_it_damages_mean_while_every_detector_misses_it():
    cfg = grid(load_scenario("evaluation/scenarios/quick.toml", SMALL))[0]
    clean = run_cell(Cell(cfg, "mean", "none", 0))
    run = CellRun(Cell(cfg, "mean", old("evade:detector=all,dir=sign"), 0))
    ratio, hidden = run.setup.settings.flag_ratio, 0
    while not run.engine.done:
        r = run.play_round()
        attack = run.threat.coalitions[2]
        if attack.last_strength is None:  # lay low: honest rows, nothing to check
            continue
        hidden += 1
        byz = torch.tensor([i in run.setup.byzantine for i in r["ids"]])
        for name in TARGETS:  # the rows the engine scored are the rows the attack checked
            s = torch.tensor(r["scores"][name], dtype=F64)
            assert float(s[byz].max()) <= threshold(s[~byz], Q) * (1 + 1e-9) + 1e-12, (r["round"], name)
        assert max(torch.tensor(r["scores"]["distance-ratio"])[byz].tolist()) <= ratio
        assert not set(r["flagged"]) & run.setup.byzantine
    record = run.record(1.0)
    assert hidden >= 12
    assert record["final_accuracy"] < clean["final_accuracy"] - 0.03
    detect = record["detect"]
    assert max(d["auc"] for d in detect.values()) <= 0.9  # an overt attack of this damage scores ~1
    # at the bench's 5% false-positive operating point the detectors catch nothing but the colluders'
    # own updates in the rounds they lie low
    assert all(d["tpr_at_5fpr"] <= 0.1 for d in detect.values())


def test_in_a_bench_cell_grad_bends_typical_rows_under_the_auc_bound_every_round():
    cfg = grid(load_scenario("evaluation/scenarios/quick.toml", SMALL))[0]
    clean = run_cell(Cell(cfg, "mean", "none", 0))
    spec, auc = old("evade:detector=all,dir=grad,jitter=typical,auc=0.7,quantile=1"), 0.7
    run = CellRun(Cell(cfg, "mean", spec, 0))
    pushed = 0
    while not run.engine.done:
        r = run.play_round()
        attack = run.threat.coalitions[2]
        byz = torch.tensor([i in run.setup.byzantine for i in r["ids"]])
        assert not set(r["flagged"]) & run.setup.byzantine
        if attack.last_strength is None:  # lay low: honest rows, nothing to check
            continue
        pushed += attack.last_strength > 0
        for name in TARGETS:  # the rows the engine scored are the rows the attack checked
            s = torch.tensor(r["scores"][name], dtype=F64)
            assert roc_auc(s, byz) <= auc + 1e-9, (r["round"], name)
            assert float(s[byz].max()) <= float(s[~byz].max()) * (1 + 1e-9) + 1e-12, (r["round"], name)
    record = run.record(1.0)
    assert pushed >= 10
    assert record["final_accuracy"] < clean["final_accuracy"] - 0.08  # 15 pp on this cell
    assert max(d["auc"] for d in record["detect"].values()) <= 0.65  # 0.56 on this cell
