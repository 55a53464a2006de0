"""The loss score (``nodes.engine.loss_score``): each row's effect on the loss of the
coordinator's root samples, scored by the round engine wherever a root set is held."""

import pytest
import torch

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import CellRun, run_cell
from nodes.engine.detectors import score_round

SMALL = {"dataset": "digits", "model": "mlp", "nodes": 10, "byzantine": 2, "rounds": 6, "partition": "iid",
         "alpha": 1.0, "protocol": "momentum", "root": 100}


def test_the_score_is_each_rows_effect_on_the_root_loss():
    run = CellRun(Cell(SMALL, "mean", "label-flip", 0))  # rows the nodes compute: no hook crafts them
    engine = run.engine
    asked = engine.select(run.ids)
    X = run.rows(asked)  # canonical order, as the engine scores them
    w = engine.w.clone()
    record = engine.step(asked, asked, X)
    root, lr = engine.root, engine.protocol.lr
    before = engine.scorer.evaluate(w, root.x, root.y)[1]
    want = [engine.scorer.evaluate(w - lr * X[i], root.x, root.y)[1] - before for i in range(len(asked))]
    assert record["scores"]["loss-score"] == pytest.approx(want, rel=1e-9, abs=1e-12)
    flipped = [i for i, fp in enumerate(record["ids"]) if fp in run.setup.byzantine]
    honest = [i for i in range(len(asked)) if i not in flipped]
    assert min(want[i] for i in flipped) > max(want[i] for i in honest)  # a label-flipper's row helps least
    assert max(want[i] for i in honest) < 0  # an honest one lowers it


def test_there_is_no_loss_score_without_a_root_set_and_malformed_effects_are_refused():
    record = run_cell(Cell({**SMALL, "root": 0, "rounds": 1}, "mean", "none", 0))
    assert "loss-score" not in record["detect"] and "median-distance" in record["detect"]
    with pytest.raises(ValueError, match=r"effects must be a float64 tensor of shape \(3,\)"):
        score_round(torch.randn(3, 2), f=0, effects=torch.zeros(2, dtype=torch.float64))


def test_the_loss_score_sees_what_geometry_misses():
    # measured (seed 0, 6 rounds, 2 of 10 nodes, mean): evade's rows, crafted to look geometrically
    # typical, reach AUC 0.83 on the loss score and at most 0.67 on the geometric detectors;
    # label-flip 1.0 on both
    detect = run_cell(Cell(SMALL, "mean", "evade", 0))["detect"]
    geometric = max(v["auc"] for k, v in detect.items() if k != "loss-score")
    assert detect["loss-score"]["auc"] > max(0.75, geometric + 0.1), detect
    assert run_cell(Cell(SMALL, "mean", "label-flip", 0))["detect"]["loss-score"]["auc"] > 0.95
