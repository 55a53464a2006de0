"""Evidence over rounds (``nodes.engine.evidence``): the CUSUM's threshold, and what it quarantines."""

from __future__ import annotations

import torch

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import run_cell
from nodes.engine import evidence
from nodes.engine.flags import FlagPolicy


def test_the_threshold_grows_with_persistence_and_never_lets_one_round_quarantine():
    floor = evidence.K
    assert evidence.threshold(0.01, 50, 0.0) == floor  # independent rounds: the one-round floor binds
    hs = [evidence.threshold(0.001, 50, rho) for rho in (0.0, 0.5, 0.9)]
    assert hs[0] == floor and hs[0] < hs[1] < hs[2]  # persistence raises the bar
    assert hs[2] > evidence.threshold(0.01, 50, 0.9) >= floor  # a stricter target, a higher bar
    assert evidence.threshold(0.001, 200, 0.9) > hs[2]  # a longer run, a higher bar
    assert all(h >= floor for h in hs)


def test_robust_z_is_relative_to_the_rounds_spread():
    z = evidence.robust_z(torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0]))
    assert z[2] == 0 and z[-1] == 2 * evidence.K and torch.isclose(z[3], torch.tensor(1 / 1.4826, dtype=torch.float64))
    assert torch.equal(evidence.robust_z(torch.ones(4)), torch.zeros(4, dtype=torch.float64))


def test_robust_z_never_divides_by_less_than_the_floor():
    # colluders on the median collapse the MAD (0.0006 here): an honest gap 0.27 above it
    # would be z = 300, capped; relative to FLOOR (0.1 cosine) it is 2.7
    gaps = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.1001, 0.0999, 0.1002, 0.37], dtype=torch.float64)
    z = evidence.robust_z(gaps)
    assert torch.isclose(z[-1], torch.tensor((0.37 - 0.1) / evidence.FLOOR, dtype=torch.float64))
    wide = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0], dtype=torch.float64)  # a spread above the floor: plain MAD
    assert torch.isclose(evidence.robust_z(wide)[-1], torch.tensor(1.0 / (1.4826 * 0.5), dtype=torch.float64))


def simulate(rho: float, byz_shift: float, nodes: int = 40, rounds: int = 30, seed: int = 0):
    """Median-cosine-like scores: AR(1) heavy-tailed honest noise per node, plus a constant shift
    for the last 4 nodes; returns (honest quarantined, Byzantine quarantined, last quarantine round)."""
    g = torch.Generator().manual_seed(seed)
    cusum, ids, z, caught = evidence.Cusum(0.01, rounds), [f"n{i:02d}" for i in range(nodes)], None, {}
    for t in range(1, rounds + 1):
        e = torch.randn(nodes, generator=g, dtype=torch.float64) / (
            torch.randn(nodes, 3, generator=g, dtype=torch.float64).square().sum(1) / 3).sqrt()
        z = e if z is None else rho * z + (1 - rho**2) ** 0.5 * e
        scores = z.clone()
        scores[-4:] += byz_shift
        for node in cusum.update(ids, scores):
            caught.setdefault(node, t)
    byz = set(ids[-4:])
    return (sum(n not in byz for n in caught), sum(n in byz for n in caught),
            max((r for n, r in caught.items() if n in byz), default=None))


def test_a_persistent_attacker_is_caught_and_honest_persistence_is_not():
    honest, byz, last = simulate(rho=0.9, byz_shift=14.0)  # z about 12 (the noise's MAD is 1.13): 2K
    assert byz == 4 and last <= 5 and honest == 0
    assert simulate(rho=0.9, byz_shift=0.0)[:2] == (0, 0)  # the same nodes, honest: nobody


def framing(floor: float, monkeypatch) -> tuple[dict, dict]:
    """Median-cosine gaps of 25 nodes for 50 rounds: 5 colluders sit on the median (MAD 0.001),
    one honest node is persistently a little off (gap 0.25 above it), and from round 20 three
    more nodes point against the median (gap 1.0 above it). Returns (quarantined, why)."""
    monkeypatch.setattr(evidence, "DIRECTION", evidence.Stream("median-cosine", floor=floor))
    policy = FlagPolicy(4.0, 3, 0.01, 50)
    ids = [f"n{i:02d}" for i in range(25)]
    for t in range(50):
        gaps = torch.tensor([0.3 + 0.001 * ((i * 7 + t) % 5) for i in range(25)], dtype=torch.float64)
        gaps[:5] = 0.302  # the colluders, on the median
        gaps[5] = 0.55  # the honest outlier
        if t >= 20:
            gaps[-3:] = 1.3
        policy.update(t, ids, {"to-median": torch.ones(25), "median-cosine": gaps}, [])
    return policy.quarantined, policy.why


def test_colluders_collapsing_the_spread_do_not_frame_an_honest_outlier(monkeypatch):
    quarantined, why = framing(evidence.FLOOR, monkeypatch)
    assert "n05" not in quarantined
    assert {n: quarantined[n] for n in ("n22", "n23", "n24")} == {"n22": 21, "n23": 21, "n24": 21}
    assert set(quarantined) == {"n22", "n23", "n24"} and set(why.values()) == {"evidence"}
    assert "n05" in framing(0.0, monkeypatch)[0]  # without the floor the collapse frames it


def test_the_policy_checkpoints_its_evidence_and_catches_sign_flip_in_the_bench():
    config = {"dataset": "digits", "model": "mlp", "nodes": 15, "byzantine": 3, "rounds": 8, "partition": "iid",
              "alpha": 1.0, "protocol": "momentum", "false-alarm": 0.01}
    record = run_cell(Cell(config, "trimmed-mean", "sign-flip", 0))
    rounds = record["rounds_to_quarantine"]
    assert len(rounds) == 3 and max(rounds.values()) <= 5, rounds
    assert record["false_quarantines"] == 0
    policy = FlagPolicy(3.0, 3, 0.01, 8)
    policy.update(1, ["a", "b", "c", "d"], {"to-median": torch.ones(4), "median-cosine": torch.tensor([0.1, 0.2, 0.3, 9.0])}, [])
    again = FlagPolicy(3.0, 3, 0.01, 8)
    again.load_state(policy.state())
    assert again.evidence.S == policy.evidence.S and again.evidence.S["d"] > 0
    for t in (2, 3):  # "d" keeps pointing away: evidence, not flags (its ratio is typical)
        again.update(t, ["a", "b", "c", "d"], {"to-median": torch.ones(4), "median-cosine": torch.tensor([0.1, 0.2, 0.3, 9.0])}, [])
    assert again.quarantined == {"d": 2} and again.why == {"d": "evidence"}
    old = {k: v for k, v in again.state().items() if k != "why"}  # a checkpoint from before `why`
    older = FlagPolicy(3.0, 3, 0.01, 8)
    older.load_state(old)
    assert older.quarantined == {"d": 2} and older.why == {}


def test_thresholds_simulated_together_are_the_ones_simulated_alone():
    together = evidence.thresholds(0.001, 30, evidence.GRID)
    for rho in (0.0, 0.5, evidence.RHO_PRIOR):
        assert together[rho] == evidence.thresholds(0.001, 30, (rho,))[rho] == evidence.threshold(0.001, 30, rho)
    assert evidence.threshold(0.001, 30, 0.33) == evidence.thresholds(0.001, 30, (0.33,))[0.33]  # off the grid: alone
