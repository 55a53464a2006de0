"""The flag policy's per-round rule (``nodes.engine.flags``): distance to the median against the
run's typical distance, not the round's."""

from __future__ import annotations

import torch

from evaluation.cell import Cell
from evaluation.local import run_cell
from nodes.engine.detectors import TO_MEDIAN, ratio_to_median
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
