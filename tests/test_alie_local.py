"""``alie-local``: ALIE played by a node that sees no other update. It computes K more honest
rows on its own data (``nodes.engine.training.estimates``) and sends their mean less z times
their spread; a volunteer and the bench's drivers compute the same bits."""

import weakref

import numpy as np
import pytest
import torch

import attacks
from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import CellRun
from evaluation.bench.scenario import grid, load_scenario
from nodes.engine.training import NodeData, compute, estimates
from nodes.volunteer.volunteer import check_attack, forge, work
from nodes.wire import Task
from robust import keys
from robust.models import build_model
from robust.params import flat_params, sha256

CPU = torch.device("cpu")
G = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 8, generator=G), torch.randint(3, (64,), generator=G)
W = flat_params(build_model("mlp", (8,), 3, seed=0))


def task(**kw) -> Task:
    base = dict(run="r", round=1, base=sha256(W), seed=0, dataset="synthetic", model="mlp", protocol="delta:steps=2",
                batch_size=8, lr=0.1, momentum=0.9, threads=1, deadline=60.0)
    return Task(**{**base, **kw})


def test_the_spec_and_its_refusals():
    attack = attacks.build("alie-local:z=1.5,estimates=4", 1)
    assert (attack.z, attack.estimates, attack.kind, attack.trains_alone) == (1.5, 4, "node", True)
    check_attack("alie-local")  # a volunteer may play it; the omniscient alie it may not
    with pytest.raises(ValueError, match="omniscient"):
        check_attack("alie")
    with pytest.raises(ValueError, match=r"estimates must be an integer in \[1, 64\]"):
        attacks.build("alie-local:estimates=0", 1)
    with pytest.raises(ValueError, match="compute them with nodes.engine.training.estimates"):
        attack.forge(W, None)
    row, own = torch.randn(5, generator=G), torch.randn(4, 5, generator=G)
    kept = row.clone(), own.clone()
    sent = attack.forge(row, None, own)
    assert torch.equal(row, kept[0]) and torch.equal(own, kept[1])  # the caller's rows untouched
    assert torch.equal(attack.forge(row, None, own), sent)


def test_a_volunteer_sends_the_mean_less_z_spreads_of_its_own_rows(tmp_path):
    key, data = keys.generate(("alie-local", 1)), NodeData("synthetic", X, Y, 3)
    node = keys.fingerprint(key.public_key())
    reply, sent = work(task(), W.numpy(), data, key, CPU, "alie-local:z=2,estimates=3", tmp_path)
    assert not reply.refused
    honest = compute(task(), W, X, Y, 3, node, CPU)[0]
    own = estimates(task(), W, X, Y, 3, node, CPU, None, 3)
    assert own.shape == (3, W.numel())
    assert all(not torch.equal(row, honest) for row in own)  # each on its own batches
    assert len({sha256(row) for row in own}) == 3
    rows = torch.cat([honest[None], own]).double()
    want = rows.mean(0) - 2 * (rows - rows.mean(0)).square().mean(0).sqrt()
    assert torch.allclose(torch.from_numpy(sent).double(), want, rtol=1e-5, atol=1e-7)
    assert not torch.equal(torch.from_numpy(sent), honest)
    # the same task asked again gives the same bits
    assert np.array_equal(work(task(), W.numpy(), data, key, CPU, "alie-local:z=2,estimates=3", tmp_path)[1], sent)
    # a volunteer's estimates wait on disk, one row read at a time: the same rows, the same forged row
    (tmp_path / "spool").mkdir()
    spooled = estimates(task(), W, X, Y, 3, node, CPU, None, 3, tmp_path / "spool")
    assert spooled.shape == (3, W.numel()) and all(torch.equal(spooled.row(i), own[i]) for i in range(3))
    attack = attacks.build("alie-local:z=2,estimates=3", 1)
    assert torch.equal(attack.forge(honest, None, spooled), attack.forge(honest, None, own))


def test_a_volunteer_holds_one_estimate_at_a_time(tmp_path, monkeypatch):
    """Each estimate written to disk is let go before the next is computed (held, it was one
    more model-sized buffer through the next trainings: 3,124 MB against 2,741 for an honest
    volunteer's tree at 100M parameters)."""
    from nodes.engine import training

    made, real = [], training.compute

    def tracked(*args, **kwargs):
        assert all(row() is None for row in made), "an earlier estimate is still held"
        out = real(*args, **kwargs)
        made.append(weakref.ref(out[0]))
        return out

    monkeypatch.setattr(training, "compute", tracked)
    (tmp_path / "spool").mkdir()
    spooled = estimates(task(), W, X, Y, 3, "n", CPU, None, 3, tmp_path / "spool")
    assert len(made) == 3 and spooled.shape == (3, W.numel())


def test_under_momentum_its_estimates_start_from_the_momentum_it_had():
    m = 0.01 * torch.randn(W.numel(), generator=G)
    t = task(protocol="momentum")
    own = estimates(t, W, X, Y, 3, "n", CPU, m, 2)
    for j, row in enumerate(own, 1):
        assert torch.equal(row, compute(t, W, X, Y, 3, f"n/estimate/{j}", CPU, "", m)[0])
    assert not torch.equal(own[0], estimates(t, W, X, Y, 3, "n", CPU, None, 1)[0])


@pytest.mark.parametrize("protocol", ["momentum", "delta:steps=2"])
def test_the_bench_computes_its_attackers_as_a_volunteer_does(protocol):
    spec = "alie-local:z=1,estimates=2"
    cfg = grid(load_scenario(None, ["rounds=3", "nodes=6", "byzantine=2", "seeds=[0]", "dataset=digits",
                                    "model=mlp", f"protocol={protocol}"]))[0]
    run = CellRun(Cell(cfg, "mean", spec, 0))
    classes = run.setup.data.classes
    for t in range(1, 4):
        w, want = run.sent, {}
        for fp in run.setup.byzantine:  # each attacker as a volunteer computes it, from the same state
            i = run.index[fp]
            m = run.momenta[i].clone()
            row, _ = compute(run.task(), w, *run.local(i), classes, fp, CPU, spec, m)
            own = lambda k: estimates(run.task(), w, *run.local(i), classes, fp, CPU, m, k)  # noqa: E731
            want[fp] = forge(spec, row, None, t, own)
        asked = run.engine.select(run.ids)
        X_ = run.rows(asked)
        run.add(run.engine.step(asked, asked, X_))
        for fp, row in want.items():
            assert torch.equal(X_[asked.index(fp)], row)
    assert run.mode == "local, attackers per node"
