"""The backdoors that change what a node trains on: DBA (a trigger split among the attackers)
and the edge-case backdoor (the tail of a class taught to be another): their pieces, the ranks
the bench gives colluding nodes, the drivers computing them as a volunteer does, and their
success on a digits cell against the clean floor."""

import math
import re

import pytest
import torch

import attacks
from evaluation.bench.cell import Cell, CellSetup, backdoor_success
from evaluation.bench.drivers.inprocess import CellRun, run_cell
from evaluation.bench.scenario import grid, load_scenario
from nodes.engine.training import compute
from nodes.volunteer.volunteer import forge

CPU = torch.device("cpu")
CELL = ["rounds=4", "nodes=7", "byzantine=2", "seeds=[0]", "dataset=digits", "model=mlp"]
G = torch.Generator().manual_seed(0)


def stamped(x: torch.Tensor) -> list[int]:
    """The features set in any sample of ``x`` (built on zeros)."""
    return x.reshape(x.shape[0], -1).nonzero()[:, 1].unique().tolist()


@pytest.mark.parametrize("part, features", [(0, range(48, 52)), (1, range(52, 56)), (3, range(60, 64)),
                                            (5, range(52, 56))])
def test_each_dba_node_stamps_its_piece_and_success_uses_them_all(part, features):
    # 4 pieces of 4 features at the end of a 64-feature sample; part 5 is piece 5 mod 4 = 1
    dba = attacks.build(f"dba:part={part}", 1)
    x, y = torch.zeros(32, 64), torch.arange(32) % 10
    px, py = dba.poison(x, y, 10, torch.Generator().manual_seed(0))
    assert stamped(px) == list(features)
    poisoned = (px != 0).any(dim=1)
    assert int(poisoned.sum()) == math.ceil(0.3125 * 32) and (py[poisoned] == 0).all()
    assert torch.equal(py[~poisoned], y[~poisoned])
    assert stamped(dba.stamp(x[:1], planted=False)) == list(range(48, 64))  # the global trigger
    assert stamped(attacks.build("backdoor", 1).stamp(x[:1])) == list(range(60, 64))  # backdoor's: unchanged


def test_a_dba_trigger_longer_than_the_sample_is_refused():
    with pytest.raises(ValueError, match=re.escape("dba's trigger reaches 40 features from a sample's end, a sample "
                                                   "has 32: lower size")):
        attacks.build("dba:size=10", 1).poison(torch.zeros(4, 32), torch.zeros(4, dtype=torch.long), 2,
                                               torch.Generator())


def test_the_bench_gives_colluding_dba_nodes_their_ranks():
    cfg = grid(load_scenario(None, [*CELL[:2], "byzantine=3", *CELL[3:]]))[0]
    setup = CellSetup(Cell(cfg, "mean", "dba:gamma=2", 0))
    ranked = sorted(setup.byzantine)
    assert [setup.attack_of(fp) for fp in ranked] == [f"dba:gamma=2,part={k}" for k in range(3)]
    assert {setup.attack_of(fp) for fp in setup.ids if fp not in setup.byzantine} == {""}
    fixed = CellSetup(Cell(cfg, "mean", "dba:part=2", 0))  # a spec that sets the piece keeps it
    assert {fixed.attack_of(fp) for fp in ranked} == {"dba:part=2"}
    plain = CellSetup(Cell(cfg, "mean", "backdoor", 0))  # no rank key: the spec as given
    assert {plain.attack_of(fp) for fp in ranked} == {"backdoor"}


@pytest.mark.parametrize("spec", ["dba", "edge-case:radius=0.5,gamma=2"])
def test_the_batched_driver_computes_these_attackers_as_a_volunteer_does(spec):
    cfg = grid(load_scenario(None, CELL))[0]
    run = CellRun(Cell(cfg, "mean", spec, 0))
    w, classes = run.engine.w, run.setup.data.classes
    want = {}
    for fp in run.setup.byzantine:  # each attacker computes its own row, from its own spec
        i = run.index[fp]
        row, _ = compute(run.task(), w, *run.local(i), classes, fp, CPU, run.setup.attack_of(fp),
                         run.momenta[i].clone())
        want[fp] = forge(run.setup.attack_of(fp), row, None, 1)
    asked = run.engine.select(run.ids)
    X = run.rows(asked)
    assert run.mode.startswith("local") and "attackers per node" not in run.mode  # the batched kernels
    for fp, row in want.items():
        torch.testing.assert_close(X[asked.index(fp)], row, rtol=1e-4, atol=1e-6)
        if spec.startswith("edge-case"):
            assert float(row.norm()) == pytest.approx(1.0, rel=1e-5)  # projected within 0.5, then doubled


def test_edge_cases_replace_a_share_of_the_nodes_samples_with_its_stretched_source_class():
    edge = attacks.build("edge-case:source=1,target=2,stretch=3,fraction=0.5", 1)
    x, y = torch.randn(20, 5, generator=G), torch.tensor([0, 1, 2, 1] * 5)
    px, py = edge.poison(x, y, 3, torch.Generator().manual_seed(4))
    mu = x[y == 1].mean(dim=0)
    changed = (px != x).any(dim=1)
    assert int(changed.sum()) <= 10 and int((py == 2).sum()) == 5 + int((changed & (y != 2)).sum())
    for row in px[changed]:  # each one an edge case of one of the node's samples of class 1
        assert any(torch.allclose(row, mu + 3 * (s - mu), atol=1e-5) for s in x[y == 1])
    assert torch.equal(edge.poison(x[y != 1], y[y != 1], 3, torch.Generator())[0], x[y != 1])  # none to stretch
    with pytest.raises(ValueError, match="edge-case source and target are both 1: choose two classes"):
        attacks.build("edge-case:source=1,target=1", 1).poison(x, y, 3, torch.Generator())
    with pytest.raises(ValueError, match="edge-case target=5 but the data has 3 classes"):
        attacks.build("edge-case:source=1,target=5", 1).poison(x, y, 3, torch.Generator())
    with pytest.raises(ValueError, match="not a text set's bytes"):
        edge.poison(torch.zeros(4, 8, dtype=torch.uint8), torch.tensor([1, 1, 0, 0]), 3, torch.Generator())


def test_edge_case_projects_then_boosts_its_update():
    row = torch.full((4,), 3.0)  # norm 6
    assert torch.equal(attacks.build("edge-case", 1).forge(row, None), row)
    assert torch.allclose(attacks.build("edge-case:radius=2,gamma=5", 1).forge(row, None), torch.full((4,), 5.0))
    assert torch.equal(attacks.build("edge-case:radius=10", 1).forge(row, None), row)  # inside the ball


# measured (seed 0, 4 rounds, 2 of 7 nodes attacking, mean): dba 0.58 against 0.0 on the clean model,
# edge-case 0.22 against 0.08 (a clean model already labels some stretched 7s as 1s)
@pytest.mark.parametrize("spec, margin", [("dba", 0.3), ("edge-case", 0.1)])
def test_a_digits_cell_carries_the_backdoor_above_the_clean_floor(spec, margin):
    cfg = grid(load_scenario(None, CELL))[0]
    record = run_cell(Cell(cfg, "mean", spec, 0))
    clean = CellRun(Cell(cfg, "mean", "none", 0))
    for _ in range(4):
        asked = clean.engine.select(clean.ids)
        clean.add(clean.engine.step(asked, asked, clean.rows(asked)))
    floor = backdoor_success(CellSetup(Cell(cfg, "mean", spec, 0)), clean.engine.w)
    assert record["backdoor_asr"] > floor + margin, (record["backdoor_asr"], floor)
