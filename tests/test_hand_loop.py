"""The hand-vectorised baseline of the bench's speed (``evaluation.peers.hand_vectorised``): its written-out
backward is autograd's, it trains, and the paired comparison runs both on one grid."""

import pytest
import torch
import torch.nn.functional as F

from evaluation.bench.cell import Cell
from evaluation.peers.hand_vectorised import gradients, paired, run_cell, split
from evaluation.bench.scenario import cells, load_scenario
from robust.data import load
from robust.models import build_model
from robust.params import flat_params, unflatten

TINY = ["nodes=6", "byzantine=1", "rounds=12", "seeds=[0]", 'aggregators=["trimmed-mean"]',
        'attacks=["none", "alie"]', "model=mlp", "protocol=momentum", "dataset=digits"]


def test_its_backward_is_autograds():
    data = load("digits")
    model = build_model("mlp", data.shape, data.classes, seed=3)
    d = sum(p.numel() for p in model.parameters())
    w = flat_params(model) + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(0))
    xb, yb = data.x_train[:48].flatten(1).view(3, 16, -1), data.y_train[:48].view(3, 16)
    hidden, features = model[1].weight.shape
    got = gradients(w, xb, yb, hidden, features, data.classes)
    for i in range(3):
        params = {k: v.detach().requires_grad_() for k, v in unflatten(w, model).items()}
        loss = F.cross_entropy(torch.func.functional_call(model, params, (xb[i],)), yb[i])
        want = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(params.values()))])
        assert torch.allclose(got[i], want, atol=1e-6)


def test_it_trains_and_the_pair_runs_both_on_one_grid():
    todo = cells(load_scenario(None, TINY))
    assert [c.attack for c in todo] == ["none", "alie"]
    assert run_cell(todo[0]) > 0.5  # 10 classes: chance is 0.1
    out = paired(None, TINY, 1)
    assert out["cells"] == 2 and out["hand_seconds"] > 0 and out["bench_seconds"] > 0
    assert out["speedup"] == out["hand_seconds"] / out["bench_seconds"]


def test_it_refuses_a_node_side_attack_it_does_not_model():
    config = cells(load_scenario(None, TINY))[0].config
    for spec in ("lazy", "backdoor:gamma=3", "neurotoxin"):
        with pytest.raises(ValueError, match="only poison data"):
            run_cell(Cell(config, "mean", spec, 0))


def test_it_leaves_the_shared_data_alone():
    before = load("digits").x_train.clone()
    run_cell(Cell({**cells(load_scenario(None, TINY))[0].config, "rounds": 1}, "mean", "backdoor", 0))
    assert torch.equal(load("digits").x_train, before)


def test_its_split_times_the_training_and_the_rule_within_the_whole():
    parts = split(None, TINY)
    assert 0 < parts["training_seconds"] and 0 < parts["rule_seconds"]
    assert parts["training_seconds"] + parts["rule_seconds"] < parts["hand_seconds"]
    assert parts["bound"] == parts["hand_seconds"] / (parts["training_seconds"] + parts["rule_seconds"]) > 1


def test_the_lockstep_microbench_times_each_kernel_alone_and_batched_with_the_same_results():
    """``evaluation.microbench.lockstep_gain``: each batched kernel computes what its one-by-one
    calls do (float rounding aside), and every row has its times."""
    from evaluation.microbench.lockstep_gain import measure

    rows = measure(cells=2, nodes=6, repeats=1)
    assert [r["kernel"] for r in rows] == ["trimmed-mean", "gram", "training", "detectors"]
    for r in rows:
        assert r["d"] == 4810 and r["alone_us"] > 0
        if r["together_us"] is not None:
            assert r["gap"] < 1e-5 and r["saved"] == pytest.approx(1 - r["together_us"] / r["alone_us"])
    assert rows[-1]["together_us"] is None and rows[-1]["fixed_us"] > 0  # the detectors: alone, and their fixed cost
