"""A3FL, the backdoor whose trigger adapts to the model it is sent: its optimisation lowers the
target's loss, the trigger stays on its features and in the data's range, the same bits twice,
the trigger kept in the node's Memory (the bench's and a volunteer's folder) and measured by the
bench's success, a digits cell against the clean floor, and its refusals."""

import math
import re

import numpy as np
import pytest
import torch

import attacks
from attacks.base import Memory, Sight
from evaluation.bench.cell import Cell, CellSetup, backdoor_success
from evaluation.bench.drivers.inprocess import CellRun, run_cell
from evaluation.bench.scenario import grid, load_scenario
from nodes.engine.training import NodeData, compute
from nodes.volunteer.volunteer import recall, work
from nodes.wire import Task
from robust import keys
from robust.models import build_model
from robust.params import flat_params, sha256, unflatten

from .test_backdoor_variants import CELL

CPU = torch.device("cpu")
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(40, 8, generator=G), torch.randint(3, (40,), generator=G)
MODEL = build_model("mlp", (8,), 3, seed=0)
W = flat_params(MODEL).detach()
QUICK = "a3fl:iters=10"


def sight(last: Memory | None = None) -> Sight:
    return Sight(MODEL, unflatten(W, MODEL), last)


def task(round: int, **kw) -> Task:
    base = dict(run="r", round=round, base="", seed=0, dataset="synthetic", model="mlp", protocol="delta:steps=4",
                batch_size=8, lr=0.1, momentum=0.9, threads=1, deadline=60.0)
    return Task(**{**base, **kw})


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_the_trigger_optimisation_lowers_the_target_loss_on_a_fixed_model(lam):
    attack = attacks.build(f"a3fl:iters=30,alpha=0.05,lam={lam}", 1)
    lo, hi = float(X.min()), float(X.max())
    start = attack.start(None, lo, hi)
    found = attack.optimise(sight(), X, Y, lo, hi)
    params = {k: p.detach() for k, p in unflatten(W, MODEL).items()}
    before, after = (float(attack.loss(sight(), params, None, X, t)) for t in (start, found))
    assert after < 0.97 * before, (before, after)  # a wrong-signed step climbs instead
    assert not torch.equal(found, start)


def test_the_adversarial_model_unlearns_the_trigger():
    attack = attacks.build("a3fl:adv_steps=50,adv_lr=0.5", 1)
    params = {k: p.detach() for k, p in unflatten(W, MODEL).items()}
    t = attack.start(None, float(X.min()), float(X.max()))
    adversarial = attack.unlearned(sight(), params, X, Y, t)
    stamped = attack.stamp(X, pattern=t)
    true = [torch.nn.functional.cross_entropy(torch.func.functional_call(MODEL, p, (stamped,)), Y)
            for p in (params, adversarial)]
    assert true[1] < 0.8 * true[0]  # the triggered samples' true labels, learnt back


def test_the_trigger_stays_on_its_features_and_within_the_data_range():
    attack = attacks.build("a3fl:iters=20,alpha=5,size=3,fraction=0.5", 1)  # huge steps: the range binds
    seen = sight()
    px, py = attack.poison(X, Y, 3, torch.Generator().manual_seed(1), seen)
    trigger = seen.kept["trigger"]
    assert trigger.shape == (3,) and bool(((trigger == X.min()) | (trigger == X.max())).all())
    changed = (px != X).any(dim=1)
    assert torch.equal((px != X).any(dim=0).nonzero().flatten(), torch.tensor([5, 6, 7]))  # the last 3 features
    assert int(changed.sum()) <= math.ceil(0.5 * 40) and (py[changed] == 0).all()
    assert bool((px[changed, 5:] == trigger).all()) and torch.equal(px[:, :5], X[:, :5])
    kept = attacks.build("a3fl:iters=1,alpha=0.01", 1).start(Memory(1, W, W, trigger=torch.full((4,), 9.0)), -1, 2)
    assert torch.equal(kept, torch.full((4,), 2.0))  # a kept trigger is clipped to this node's range


def test_an_attacker_computes_the_same_bits_twice_and_trains_alone():
    runs = []
    for _ in range(2):
        kept = {}
        row, _ = compute(task(1), W, X, Y, 3, "node", CPU, QUICK, kept=kept)
        runs.append((row, kept["trigger"]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    other = compute(task(1), W, X, Y, 3, "other", CPU, QUICK)[0]  # another node: other poison draws
    assert not torch.equal(other, runs[0][0])
    attack = attacks.build(QUICK, 1)
    assert attack.trains_alone and attack.remembers and attack.sees_model and attack.plants_backdoor
    assert not attacks.build("backdoor", 1).sees_model


def test_a_round_starts_from_the_trigger_kept_last_round():
    kept = {}
    compute(task(1), W, X, Y, 3, "node", CPU, QUICK, kept=kept)
    last = Memory.after(1, W, W, kept, None)
    assert torch.equal(last.trigger, kept["trigger"])
    again = {}
    compute(task(2), W, X, Y, 3, "node", CPU, "a3fl:iters=1,alpha=1e-6", last=last, kept=again)
    assert torch.allclose(again["trigger"], last.trigger, atol=1e-5)  # one tiny step from it
    assert Memory.after(3, W, W, {}, last).trigger is last.trigger  # an honest round keeps the last trigger


def test_a_volunteer_keeps_its_trigger_in_its_folder(tmp_path):
    key, data, folder = keys.generate(("a3fl-test", 1)), NodeData("synthetic", X, Y, 3), tmp_path / "node"
    rows = []
    for t in (1, 2):
        reply, row = work(task(t, base=sha256(W)), W.numpy(), data, key, CPU, QUICK, folder)
        assert not reply.refused
        rows.append(row)
        kept = recall(folder, task(t + 1), QUICK, W.numel())
        assert kept.round == t and kept.trigger.shape == (4,)
    fp = keys.fingerprint(key.public_key())
    first = {}
    compute(task(1), W, X, Y, 3, fp, CPU, QUICK, kept=first)
    assert torch.equal(recall(folder, task(2), QUICK, W.numel()).trigger, first["trigger"])
    again = work(task(2, base=sha256(W)), W.numpy(), data, key, CPU, QUICK, folder)[1]  # round 2 asked again
    assert np.array_equal(again, rows[1])


def test_the_success_measurement_uses_the_attackers_last_triggers():
    cfg = grid(load_scenario(None, [*CELL[:1], "rounds=2", *CELL[1:]]))[0]
    run = CellRun(Cell(cfg, "mean", QUICK, 0))
    while run.play_round() is not None:
        pass
    assert run.mode == "local, attackers per node"
    triggers = [m.trigger for m in run.memories]
    assert len(triggers) == 2 and all(t is not None for t in triggers)
    data, attack, model = run.setup.data, run.setup.attack, run.setup.model()
    each = [attack.carried(model, run.engine.w, data.x_test, data.y_test, t) for t in triggers]
    assert run.record(0.0)["backdoor_asr"] == pytest.approx(sum(each) / 2)
    # two triggers that differ: the mean of each one's success, none kept: the starting pattern's
    lo, hi = float(data.x_test.min()), float(data.x_test.max())
    kept = [Memory(2, run.engine.w, run.engine.w, trigger=torch.tensor(t)) for t in ([lo] * 4, [hi] * 4)]
    each = [attack.carried(model, run.engine.w, data.x_test, data.y_test, m.trigger) for m in kept]
    assert each[0] != each[1]
    assert backdoor_success(run.setup, run.engine.w, kept) == pytest.approx(sum(each) / 2)
    assert backdoor_success(run.setup, run.engine.w) == attack.carried(model, run.engine.w, data.x_test, data.y_test,
                                                                       torch.full((4,), hi))


# measured (seed 0, 4 rounds, 2 of 7 nodes attacking, mean): 0.39, against 0.0 for the attackers'
# last triggers on the clean model (a backdoor, not an adversarial patch)
def test_a_digits_cell_carries_the_backdoor_above_the_clean_floor():
    cfg = grid(load_scenario(None, CELL))[0]
    spec = "a3fl:iters=20,fraction=0.5"
    run = CellRun(Cell(cfg, "mean", spec, 0))
    while run.play_round() is not None:
        pass
    clean = CellRun(Cell(cfg, "mean", "none", 0))
    while clean.play_round() is not None:
        pass
    floor = backdoor_success(run.setup, clean.engine.w, run.memories)
    asr = run.record(0.0)["backdoor_asr"]
    assert asr > floor + 0.25, (asr, floor)


@pytest.mark.parametrize("spec, words", [
    ("a3fl:iters=0", "a3fl: iters must be an integer >= 1 (got iters=0)"),
    ("a3fl:alpha=0", "a3fl: alpha must be a number > 0 (got alpha=0)"),
    ("a3fl:lam=-1", "a3fl: lam must be a number >= 0"),
    ("a3fl:adv_steps=1.5", "a3fl: adv_steps must be an integer >= 0"),
    ("a3fl:adv_lr=0", "a3fl: adv_lr must be a number > 0"),
    ("a3fl:samples=0", "a3fl: samples must be an integer >= 1"),
    ("a3fl:fraction=0", "a3fl: fraction must be a number in (0, 1]"),
    ("a3fl:lambda=1", "a3fl: unknown key lambda"),
])
def test_bad_parameters_are_refused_in_one_line(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        attacks.build(spec, 1)


@pytest.mark.parametrize("spec, x, y, seen, words", [
    ("a3fl:target=5", X, Y, True, "a3fl target=5 but the data has 3 classes"),
    ("a3fl:size=9", X, Y, True, "a3fl's trigger reaches 9 features from a sample's end, a sample has 8: lower size"),
    ("a3fl", X, Y, False, "a3fl optimises its trigger against the model it is sent"),
    ("a3fl", torch.zeros(4, 8, dtype=torch.uint8), Y[:4], True, "a3fl optimises feature values"),
])
def test_data_it_cannot_poison_is_refused(spec, x, y, seen, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        attacks.build(spec, 1).poison(x, y, 3, torch.Generator(), sight() if seen else None)
