"""The loss score (``nodes.engine.loss_ratings``): each row's effect on the loss of the
coordinator's root samples, scored by the round engine wherever a root set is held."""

import re

import pytest
import torch

import aggregators
from aggregators import RoundInputs
from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import CellRun, run_cell
from nodes.dashboard.view import _quarantine_reason
from nodes.engine.detectors import score_round
from nodes.engine.flags import FlagPolicy
from nodes.engine.loss_ratings import Ratings
from nodes.settings import Settings
from nodes.strategy import RobustStrategy

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
    n = len(asked)  # each row at its share of the mean
    want = [engine.scorer.evaluate(w - lr * (X[i] / n), root.x, root.y)[1] - before for i in range(n)]
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
    detect = run_cell(Cell(SMALL, "mean", "evade:detector=geometric", 0))["detect"]
    geometric = max(v["auc"] for k, v in detect.items() if k != "loss-score")
    assert detect["loss-score"]["auc"] > max(0.75, geometric + 0.1), detect
    assert run_cell(Cell(SMALL, "mean", "label-flip", 0))["detect"]["loss-score"]["auc"] > 0.95


def test_ratings_rank_each_round_and_keep_across_rounds():
    ratings = Ratings()
    ids = ["a", "b", "c"]
    assert ratings.ordinals(ids).tolist() == [0.0, 0.0, 0.0]  # a newcomer: 25 - 3 * 25/3
    ratings.update(ids, torch.tensor([-0.5, 0.1, -0.2], dtype=torch.float64))  # a helped most, b least
    first = ratings.ordinals(ids)
    assert first[0] > first[2] > first[1]
    for _ in range(5):
        ratings.update(ids, torch.tensor([-0.5, 0.1, -0.2], dtype=torch.float64))
    assert ratings.ordinals(ids)[0] > first[0] and ratings.ordinals(ids)[1] < first[1]  # more rounds, surer
    again = Ratings()
    again.load_state(ratings.state())
    assert torch.equal(again.ordinals(ids), ratings.ordinals(ids))
    ratings.update(["a"], torch.tensor([9.0], dtype=torch.float64))  # one node ranks against nobody
    assert torch.equal(again.ordinals(ids), ratings.ordinals(ids))
    tied = Ratings()
    tied.update(ids, torch.zeros(3, dtype=torch.float64))  # equal effects share a rank
    assert len(set(tied.ordinals(ids).tolist())) == 1


def test_the_rule_averages_the_best_rated_rows():
    X = torch.tensor([[0.0, 0.0], [1.0, 1.0], [10.0, 10.0], [2.0, 0.0]], dtype=torch.float64)
    agg = aggregators.build("loss-score", 1)
    # ratings 3, 1, -2, 1: the three best are rows 0, 1, 3 (rows 1 and 3 tie: both kept) -> (1, 1/3)
    out = agg(X, RoundInputs(ratings=torch.tensor([3.0, 1.0, -2.0, 1.0], dtype=torch.float64)))
    assert torch.allclose(out, torch.tensor([1.0, 1 / 3], dtype=torch.float64))
    assert agg.last_kept.tolist() == [True, True, False, True]
    two = aggregators.build("loss-score:m=2", 1)  # a tie at the boundary: the lower row
    assert two(X, RoundInputs(ratings=torch.tensor([3.0, 1.0, -2.0, 1.0], dtype=torch.float64))).tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"loss-score needs each row's node's loss-score rating \(n,\)"):
        agg(X)
    with pytest.raises(ValueError, match=re.escape("loss-score: ratings has shape (3,), the rows have n=4")):
        agg(X, RoundInputs(ratings=torch.zeros(3, dtype=torch.float64)))
    with pytest.raises(ValueError, match="loss-score tracks each node across rounds"):
        aggregators.build("nnm+loss-score", 1)


def test_the_rule_needs_a_root_set_wherever_it_can_be_set():
    with pytest.raises(ValueError, match=r"needs each row's node's loss-score rating \(n,\), which the coordinator "
                                         r"computes on clean data it holds: set root = N"):
        Settings(aggregator="loss-score", root=0)
    with pytest.raises(ValueError, match=r"RobustStrategy: loss-score needs what the server computes on root data"):
        RobustStrategy("loss-score", 1)


def test_a_cell_under_the_rule_leaves_out_its_label_flippers_and_resumes_to_the_same_bits():
    config = {**SMALL, "rounds": 6}
    run = CellRun(Cell(config, "loss-score", "label-flip", 0))
    for _ in range(3):
        run.play_round()
    flippers = [i for i, fp in enumerate(run.records[-1]["ids"]) if fp in run.setup.byzantine]
    assert not any(run.engine.chain.last_kept[i] for i in flippers)  # by round 3 both rate worst
    state = run.engine.state()
    assert len(state["ratings"]["ids"]) == 10
    other = CellRun(Cell(config, "loss-score", "label-flip", 0))
    for _ in range(3):  # the nodes' own momenta advance as they did in the first run
        other.play_round()
    other.engine.ratings = Ratings()  # forgotten: the checkpoint brings them back
    other.engine.load_state(state)
    assert [run.play_round()["model_sha256"] for _ in range(3)] == [other.play_round()["model_sha256"] for _ in range(3)]


def test_loss_evidence_needs_a_root_set_and_a_false_alarm_target():
    for values in ({"root": 0}, {"root": 100, "false_alarm": 0.0}):
        with pytest.raises(ValueError, match=r"loss-evidence needs a root set and a false-alarm target .* or "
                                             r"loss-evidence = false"):
            Settings(loss_evidence=True, **values)


def test_the_loss_evidence_shares_the_target_quarantines_and_checkpoints():
    policy = FlagPolicy(4.0, 3, 0.01, 20, loss=True)
    assert policy.evidence.false_alarm == policy.loss_evidence.false_alarm == 0.005  # the target, shared
    assert FlagPolicy(4.0, 3, 0.01, 20).loss_evidence is None  # off unless asked
    ids = [f"n{i}" for i in range(8)]
    direction = torch.tensor([0.1 * (i % 3) for i in range(8)], dtype=torch.float64)  # nobody's direction is odd
    effects = torch.tensor([-0.01 * (1 + i % 4) for i in range(8)], dtype=torch.float64)
    effects[-1] = 0.2  # n7's rows keep raising the root loss
    for t in range(1, 6):
        policy.update(t, ids, {"to-median": torch.ones(8), "median-cosine": direction, "loss-score": effects}, [])
    assert policy.quarantined == {"n7": 3} and policy.why == {"n7": "loss score"}  # z capped at 2k = 8: S 4, 8, 12
    again = FlagPolicy(4.0, 3, 0.01, 20, loss=True)
    again.load_state(policy.state())
    assert again.loss_evidence.S == policy.loss_evidence.S and again.evidence.S == policy.evidence.S
    record = {"loss_evidence": {"h": policy.loss_evidence.h, "S": {"n7": policy.loss_evidence.S["n7"]}}}
    reason = _quarantine_reason(record, "n7", "loss score", Settings(loss_evidence=True, root=100))
    assert reason.startswith("its loss-score evidence ") and "shared by both kinds of evidence" in reason


def test_the_loss_evidence_catches_label_flippers_the_geometry_misses_and_no_honest_node():
    # the quick scenario (digits, 25 nodes of which 5 flip labels, 50 rounds) with a root set: measured,
    # the loss score quarantines 3 flippers by rounds 35-43, the direction's evidence and the flags none
    config = {"dataset": "digits", "partition": "dirichlet", "alpha": 1.0, "model": "mlp", "nodes": 25,
              "byzantine": 5, "rounds": 50, "batch-size": 32, "lr": 0.05, "momentum": 0.9, "protocol": "momentum",
              "root": 100}
    run = CellRun(Cell({**config, "loss-evidence": True}, "mean", "label-flip", 1))
    while run.play_round() is not None:
        pass
    flags = run.engine.flags
    assert set(flags.quarantined) <= run.setup.byzantine and len(flags.quarantined) >= 2, flags.quarantined
    assert set(flags.why.values()) == {"loss score"}
    assert all("loss_evidence" in r for r in run.records)


def test_the_cost_microbench_times_the_score_beside_the_rule():
    from evaluation.microbench.loss_score_cost import measure

    row = measure("digits", "mlp", "momentum", n=6, root=20, repeats=1)
    assert row["d"] == 4810 and row["n"] == 6 and row["loss_score_s"] > 0 and row["rule_and_detectors_s"] > 0
    assert row["per_row_ms"] == pytest.approx(1000 * row["loss_score_s"] / 6)
    assert row["ratio"] == pytest.approx(row["loss_score_s"] / row["rule_and_detectors_s"])
