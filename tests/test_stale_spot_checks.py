"""Spot checks of stale rows: a straggler's update (``round = async``, ``late = carry``) is
recomputed from its own task (the older model it was sent, its own task number), in the
bench's drivers and in the coordinator. An honest straggler is never convicted; a lazy or
forging one is."""

from __future__ import annotations

import dataclasses

import pytest

from evaluation.bench.cell import Cell
from evaluation.bench.drivers.inprocess import CellRun

from .federation_kit import fingerprint
from .test_async_deploy import SETTINGS as ASYNC, records, serve_fake

# 3 slow nodes of 8: async buffers hold their stale replies; sync rounds with a deadline carry
# them (a task takes 0.02 s, 0.06 s on a slow node: its reply counts one round late). Spot
# checks on every row, the delta protocol (what a verifier can recompute).
BASE = {"dataset": "digits", "model": "mlp", "nodes": 8, "byzantine": 2, "rounds": 4, "partition": "iid",
        "alpha": 1.0, "protocol": "delta:steps=2", "step-seconds": 0.01, "spot-check": 1.0, "quarantine-after": 1000}
MODES = {"async": {"round": "async", "speed": "slow:fraction=0.4,factor=10"},
         "carry": {"late": "carry", "deadline": 0.05, "speed": "slow:fraction=0.4,factor=3"}}


def play(config: dict, attack: str, seed: int, vectorize: bool) -> tuple[CellRun, list[dict]]:
    run = CellRun(Cell(config, "trimmed-mean", attack, seed), vectorize)
    out = []
    while not run.engine.done and (record := run.play_round()) is not None:
        out.append(record)
    return run, out


def stale_checks(records: list[dict]) -> int:
    """How many of the checked rows were stale."""
    return sum(r["staleness"].get(v["author"], 0) > 0 for r in records for v in r["spot"])


@pytest.mark.parametrize("mode", MODES)
def test_an_honest_straggler_is_never_convicted_whatever_the_draw(mode):
    checked = stale = 0
    for seed in range(3):
        for vectorize in (False, True):  # bit for bit against a volunteer's rows; within the tolerance of batched ones
            run, log = play({**BASE, **MODES[mode]}, "none", seed, vectorize)
            assert not any(r["convicted"] for r in log), (mode, seed, vectorize)
            checked += sum(len(r["spot"]) for r in log)
            stale += stale_checks(log)
    assert checked > 100 and stale > 20, (checked, stale)  # many stale rows were recomputed, and cleared


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attack", ["lazy", "forge:scale=0.99"])
def test_a_lazy_or_forging_straggler_is_convicted_and_no_honest_node(mode, attack):
    # every node slow: with carry each reply misses its round's deadline, every row is stale
    config = {**BASE, **MODES[mode], "speed": "slow:fraction=1,factor=3", "rounds": 8}
    run, log = play(config, attack, 0, False)
    assert {fp for r in log for fp in r["convicted"]} == run.setup.byzantine
    stale = {fp for r in log for fp in r["convicted"] if r["staleness"][fp] > 0}
    assert stale == run.setup.byzantine if mode == "carry" else stale_checks(log) > 0


def test_the_coordinator_recomputes_a_stale_reply_from_its_own_task(tmp_path):
    """Async, every reply spot-checked by the coordinator (int8 on the wire): held replies are
    stale, recomputed from the model they were sent, and cleared bit for bit; a lazy node (its
    last task's update sent again) is convicted."""
    settings = dataclasses.replace(ASYNC, spot_check=1.0, verifier="self", rounds=4)
    coord_dir, _ = serve_fake(tmp_path / "honest", settings)
    log = records(coord_dir)
    assert not any(r["convicted"] for r in log)
    assert sum(r["staleness"][v["author"]] > 0 for r in log for v in r["spot"]) >= 1
    assert all(v["distance"] == 0.0 for r in log for v in r["spot"])  # the same profile: bit for bit
    coord_dir, nodes = serve_fake(tmp_path / "lazy", settings, {1: "lazy"})
    log = records(coord_dir)
    assert {fp for r in log for fp in r["convicted"]} == {fingerprint(nodes[0])}
