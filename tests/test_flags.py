"""The flag policy's per-round rule (``nodes.engine.flags``): distance to the median against the
run's typical distance, not the round's, and against the node's own where that is larger."""

from __future__ import annotations

import pytest
import torch

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import run_cell
from nodes.engine.detectors import ratio_to_median
from nodes.engine.names import TO_MEDIAN
from nodes.engine.flags import FlagPolicy

IDS = [f"n{i:02d}" for i in range(10)]


def converging(policy: FlagPolicy, far: dict[int, float], rounds: int = 12) -> list[list[str]]:
    """Rounds in which nine rows shrink (typical distance 1.0, then halving every round) and the
    rows in ``far`` keep their distance; returns each round's flagged nodes."""
    flagged = []
    for t in range(rounds):
        d = torch.full((10,), 0.5**t, dtype=torch.float64)
        for i, dist in far.items():
            d[i] = dist
        flagged.append(policy.update(t + 1, IDS, {TO_MEDIAN: d}, []))
    return flagged


def test_a_row_that_keeps_its_distance_while_the_others_shrink_is_not_flagged():
    policy = FlagPolicy(4.0, 3)
    flagged = converging(policy, {9: 3.0})
    assert flagged == [[]] * 12 and policy.quarantined == {} and policy.typical == 1.0
    # the same round judged against its own median: 3 / 2^-11, flagged every round from the third
    d = torch.tensor([0.5**11] * 9 + [3.0], dtype=torch.float64)
    assert float(ratio_to_median(d)[9]) > 4.0


def test_a_row_beyond_ratio_times_the_runs_typical_distance_is_quarantined():
    policy = FlagPolicy(4.0, 3)
    flagged = converging(policy, {8: 3.0, 9: 4.5})
    assert flagged == [["n09"]] * 12
    assert policy.quarantined == {"n09": 3} and policy.why == {"n09": "flags"}


def test_the_typical_distance_grows_with_the_run_and_is_checkpointed():
    policy = FlagPolicy(4.0, 3)
    policy.update(1, IDS, {TO_MEDIAN: torch.ones(10, dtype=torch.float64)}, [])
    policy.update(2, IDS, {TO_MEDIAN: torch.full((10,), 2.0, dtype=torch.float64)}, [])
    assert policy.typical == 2.0
    again = FlagPolicy(4.0, 3)
    again.load_state(policy.state())
    assert again.typical == 2.0
    d = torch.tensor([0.01] * 9 + [7.9], dtype=torch.float64)
    assert not again.flags_rows({TO_MEDIAN: d}).any()  # 7.9 < 4 x 2.0
    older = FlagPolicy(4.0, 3)
    older.load_state({k: v for k, v in policy.state().items() if k != "typical"})  # a checkpoint from before it
    assert older.typical == 0.0 and older.flags_rows({TO_MEDIAN: d}).tolist() == [False] * 9 + [True]


def drifting(policy: FlagPolicy, node: dict[int, float], rounds: int) -> list[list[str]]:
    """Rounds in which nine rows sit at distance 1.0 and row 9 at ``node[t]`` (its last value
    from then on); returns each round's flagged nodes."""
    flagged, last = [], 1.0
    for t in range(rounds):
        last = node.get(t, last)
        d = torch.tensor([1.0] * 9 + [last], dtype=torch.float64)
        flagged.append(policy.update(t + 1, IDS, {TO_MEDIAN: d}, []))
    return flagged


def test_a_node_that_drifts_slowly_is_judged_against_its_own_distance():
    # an honest node the model fits least: 2x the typical distance for 20 rounds, then 3x, 5x, 7x
    policy = FlagPolicy(4.0, 3)
    flagged = drifting(policy, {0: 2.0, 20: 3.0, 30: 5.0, 40: 7.0}, 60)
    assert flagged == [[]] * 60 and policy.quarantined == {}
    assert 2.0 < policy.level("n09") < 7.0 and policy.level("n00") == 1.0
    # against the run's typical distance alone (no ids, or a node without history), 5x is flagged
    five = {TO_MEDIAN: torch.tensor([1.0] * 9 + [5.0], dtype=torch.float64)}
    assert policy.flags_rows(five, IDS).tolist()[9] is False
    assert policy.flags_rows(five).tolist()[9] is True and FlagPolicy(4.0, 3).flags_rows(five, IDS).tolist()[9] is True
    # flag-own = false: the run's typical distance alone, the policy before the node's own
    runs = FlagPolicy(4.0, 3, own=False)
    assert drifting(runs, {0: 2.0, 20: 3.0, 30: 5.0, 40: 7.0}, 60)[30:33] == [["n09"]] * 3
    assert runs.quarantined == {"n09": 33}


def test_a_flagged_row_never_raises_its_nodes_allowance():
    # a node that lies from its first round: flagged every round, its own level stays 0
    policy = FlagPolicy(4.0, 3)
    assert drifting(policy, {0: 50.0}, 5) == [["n09"]] * 5
    assert policy.quarantined == {"n09": 3} and policy.level("n09") == 0.0
    # one that lies low, then jumps: judged against what it sent while unflagged
    policy = FlagPolicy(4.0, 3)
    flagged = drifting(policy, {0: 1.0, 10: 4.5}, 13)
    assert flagged[9:] == [[], ["n09"], ["n09"], ["n09"]] and policy.quarantined == {"n09": 13}
    # a ramp of 1.5x a round outruns its own geometric mean within a few rounds
    policy = FlagPolicy(4.0, 3)
    flagged = drifting(policy, {t: 1.5**t for t in range(30)}, 30)
    first = next(t for t, f in enumerate(flagged) if f)
    assert first < 12 and policy.quarantined["n09"] <= first + 3


def test_the_nodes_own_levels_are_checkpointed():
    policy = FlagPolicy(4.0, 3)
    drifting(policy, {0: 3.0}, 5)
    again = FlagPolicy(4.0, 3)
    again.load_state(policy.state())
    assert again.own == policy.own and again.level("n09") == policy.level("n09") == pytest.approx(3.0)
    older = FlagPolicy(4.0, 3)
    older.load_state({k: v for k, v in policy.state().items() if k != "own"})  # a checkpoint from before it
    assert older.own == {} and older.typical == policy.typical


def test_rows_all_at_the_median_flag_only_a_row_that_is_not():
    policy = FlagPolicy(4.0, 3)
    d = torch.tensor([0.0, 0.0, 0.0, 1e-30], dtype=torch.float64)
    assert policy.flags_rows({TO_MEDIAN: d}).tolist() == [False, False, False, True]


def test_local_steps_with_outer_momentum_quarantine_no_honest_node():
    """Non-IID digits, 16 local steps a round and outer Nesterov momentum, no attack: as the
    model fits most nodes' data, their deltas shrink 100x while a few nodes' stay; judged
    against each round's own median those few were quarantined (12 of 15 here)."""
    config = {"dataset": "digits", "model": "mlp", "nodes": 15, "byzantine": 0, "rounds": 40,
              "partition": "dirichlet", "alpha": 1.0, "lr": 0.1, "momentum": 0.9,
              "protocol": "delta:steps=16,server_lr=0.7,server_momentum=0.9,nesterov=true"}
    record = run_cell(Cell(config, "nnm+trimmed-mean", "none", 0))
    assert record["false_quarantines"] == 0


def test_a_flag_says_whose_typical_distance_it_was_judged_against():
    from nodes.dashboard.view import _flag_reason

    record = {"ids": ["a", "b"], "scores": {TO_MEDIAN: [9.0, 1.0]}, "typical": 1.0, "own": {}}
    assert _flag_reason(record, "a", 4.0) == "9.0x the run's typical distance to the median (flagged above 4x)"
    record["own"] = {"a": 2.0}  # the engine's record names a flagged node's own level where it was the bar
    assert _flag_reason(record, "a", 4.0) == "4.5x its own typical distance to the median (flagged above 4x)"
    del record["own"]  # a record from before the node's own level
    assert _flag_reason(record, "a", 4.0).startswith("9.0x the run's")
