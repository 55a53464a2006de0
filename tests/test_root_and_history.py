"""Rules that need more than the rows, played by the round engine: FLTrust on the
coordinator's root data, FoolsGold and FLDetector following nodes by id, and attacks that
search against them."""

import pytest
import torch

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import CellRun, run_cell
from nodes.engine.root import Root
from nodes.settings import Settings
from nodes.strategy import RobustStrategy

SMALL = {"dataset": "digits", "model": "mlp", "nodes": 10, "byzantine": 2, "rounds": 6, "partition": "iid",
         "alpha": 1.0, "protocol": "momentum"}


def test_fltrust_asks_for_root_data_everywhere_it_can_be_set():
    with pytest.raises(ValueError, match=r"set root = N"):
        Settings(aggregator="fltrust", root=0)
    with pytest.raises(ValueError, match=r"does not hold"):
        RobustStrategy("fltrust", 1)
    with pytest.raises(ValueError, match=r"root=99999 but the training set has"):
        run_cell(Cell({**SMALL, "root": 99_999}, "fltrust", "none", 0))


def test_fltrust_weighs_out_sign_flip_with_the_root_update_and_resumes_to_the_same_bits():
    config = {**SMALL, "root": 100}
    record = run_cell(Cell(config, "fltrust", "sign-flip", 0))
    assert record["detect"]["discarded"]["auc"] == 1.0  # every flipped row got trust 0, no honest one
    clean = run_cell(Cell(config, "fltrust", "none", 0))
    assert record["final_accuracy"] > clean["final_accuracy"] - 0.05
    run = CellRun(Cell(config, "fltrust", "sign-flip", 0))
    for _ in range(3):
        run.play_round()
    state = run.engine.state()
    assert state["root"]["m"].abs().sum() > 0  # the root's momentum is kept (momentum protocol)
    other = CellRun(Cell(config, "fltrust", "sign-flip", 0))
    for _ in range(3):
        other.play_round()
    other.engine.load_state(state)
    assert [run.play_round()["model_sha256"] for _ in range(3)] == [other.play_round()["model_sha256"] for _ in range(3)]
    assert run.records[-1]["model_sha256"] == record["model_sha256"]


def test_the_root_is_a_seeded_draw_of_the_training_set():
    setup = CellRun(Cell({**SMALL, "root": 50}, "fltrust", "none", 0)).setup
    a, b = Root(setup.settings, setup.data), Root(setup.settings, setup.data)
    assert torch.equal(a.x, b.x) and a.x.shape[0] == 50
    w = torch.zeros(CellRun(Cell({**SMALL, "root": 50}, "fltrust", "none", 0)).engine.w.numel())
    assert a.update(1, w) is a.update(1, w)  # one reference per round: the momentum advances once
    assert torch.equal(a.update(1, w), b.update(1, w))


@pytest.mark.parametrize("rule", ["foolsgold", "fldetector:window=2"])
def test_rules_that_follow_nodes_run_in_the_engine_and_resume(rule):
    config = {**SMALL, "rounds": 6}
    record = run_cell(Cell(config, rule, "ipm:eps=0.5", 0))
    assert 0 < record["final_accuracy"] <= 1
    run = CellRun(Cell(config, rule, "ipm:eps=0.5", 0))
    for _ in range(3):
        run.play_round()
    other = CellRun(Cell(config, rule, "ipm:eps=0.5", 0))
    other.engine.load_state(run.engine.state())
    other.threat.previous = run.threat.previous
    other.momenta = run.momenta.clone()
    assert [run.play_round()["model_sha256"] for _ in range(3)] == [other.play_round()["model_sha256"] for _ in range(3)]
    assert run.records[-1]["model_sha256"] == record["model_sha256"]


def test_foolsgold_gives_sybils_no_weight_in_the_bench():
    # mimic: every Byzantine node sends one honest node's row, round after round
    record = run_cell(Cell({**SMALL, "rounds": 8}, "foolsgold", "mimic", 0))
    assert record["detect"]["discarded"]["auc"] > 0.9


@pytest.mark.parametrize("attack", ["optimal-alie", "fang-krum"])
def test_attacks_search_against_rules_that_follow_nodes(attack):
    run = CellRun(Cell({**SMALL, "rounds": 3}, "foolsgold", attack, 0))
    X = torch.randn(len(run.ids), run.engine.w.numel())
    crafted = run.threat.rows(run.engine, 1, run.ids, X)  # searches call the rule with the round's ids
    byz = run.threat._mask(run.ids)
    assert not torch.equal(crafted[byz], X[byz]) and torch.equal(crafted[~byz], X[~byz])
    assert run.engine.chain.state() == {}  # the searches ran on copies: the deployed rule saw nothing yet
