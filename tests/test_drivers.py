"""One engine, three drivers: a bench cell computed node by node in-process, through Flower's
simulation engine (the coordinator's own ServerApp and ClientApp) and through real
SuperLink/SuperNode processes on loopback ends with the same model bits. Neurotoxin's nodes
keep the model they were last sent in their folders (its mask in round 2): the per-node
driver's memory, bit for bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

# quarantine at the first flag: nodes are quarantined in a few cells, and an `inf` node in
# every one of its cells, leaving 2 nodes where the quorum is 3 (the round skips at once)
BASE = ["rounds=2", "nodes=3", "byzantine=1", "dataset=digits", "model=mlp", "protocol=momentum", "quarantine-after=1"]
GRID = BASE + ["seeds=[0, 1]", 'aggregators=["trimmed-mean", "bucketing:s=2+centered-clipping:tau=10,iters=3"]',
               'attacks=["none", "alie:z=1", "label-flip", "inf", "neurotoxin:k=5"]']
NODE_SIDE = BASE + ["seeds=[0]", 'aggregators=["trimmed-mean"]', 'attacks=["none", "label-flip"]']


def bench(out, scenario, *extra, home, env=None, command=(sys.executable, "-m", "robust.cli")):
    cmd = [*command, "bench", "--out", str(out), *extra]
    for item in scenario:
        cmd += ["--set", item]
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def shas(out):
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {(r["aggregator"], r["attack"], r["seed"]): r["model_sha256"] for r in rows}, rows


def test_per_node_flower_and_deploy_give_the_same_bits(tmp_path):
    home = tmp_path / "home"
    per_node = bench(tmp_path / "per-node", GRID, "--no-vectorize", home=home, env={"OMP_NUM_THREADS": "1"})
    assert per_node.returncode == 0, per_node.stderr[-3000:]
    want, reference = shas(tmp_path / "per-node")
    trained = [v for k, v in want.items() if k[1] != "inf"]
    assert len(trained) == 16 and len(set(trained)) == 16  # every cell trained a different model
    for r in reference:
        if r["attack"] == "inf":  # rejected and quarantined in round 1; trimmed mean needs 3 rows: no step
            assert list(r["rounds_to_quarantine"].values()) == [0]
            assert r["skipped_rounds"] == (2 if r["aggregator"] == "trimmed-mean" else 0)

    flower = bench(tmp_path / "flower", GRID, "--engine", "flower", home=home)
    assert flower.returncode == 0, flower.stderr[-3000:]
    got, rows = shas(tmp_path / "flower")
    assert got == want
    assert all(r["engine"] == "flower" and len(r["accuracy"]) == 2 and len(r["kappa"]) == 2 for r in rows)
    again = bench(tmp_path / "flower", GRID, "--engine", "flower", home=home)
    assert again.returncode == 0 and "20 cells (20 already in" in again.stderr  # nothing runs twice

    # the real thing, started as a pipx or systemd user would: by absolute path, no venv on
    # PATH, and with another thread count than the reference
    robust = Path(sys.executable).with_name("robust")
    deploy = bench(tmp_path / "deploy", NODE_SIDE, "--engine", "deploy", home=home, command=(str(robust),),
                   env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    got, rows = shas(tmp_path / "deploy")
    assert got == {k: v for k, v in want.items() if k[0] == "trimmed-mean" and k[2] == 0 and k[1] in ("none", "label-flip")}
    assert all(r["engine"] == "deploy" and r["kappa"] is None for r in rows)


# a schedule: one node of 4 three times slower (a task takes 0.01 s, 0.03 s on it). Async:
# buffers of 3 fill without it, its replies come stale; carry: it misses each 0.02 s deadline
# and its reply counts, stale, in the next round.
TIMED = ["rounds=3", "nodes=4", "byzantine=1", "dataset=digits", "model=mlp", "protocol=momentum", "seeds=[0]",
         "step-seconds=0.01", "speed=\"slow:fraction=0.25,factor=3\"", 'aggregators=["trimmed-mean"]']
SCHEDULES = {"async": ["round=async"], "carry": ["late=carry", "deadline=0.02"]}


def test_async_and_carried_cells_give_the_same_bits_through_flower_and_run_deployed(tmp_path):
    from evaluation.bench.cell import Cell
    from evaluation.bench.drivers.inprocess import CellRun
    from evaluation.bench.scenario import grid, load_scenario

    home = tmp_path / "home"
    for name, schedule in SCHEDULES.items():
        scenario = TIMED + schedule + ['attacks=["none", "alie:z=1", "label-flip"]']
        per_node = bench(tmp_path / f"{name}-per-node", scenario, "--no-vectorize", home=home)
        assert per_node.returncode == 0, per_node.stderr[-3000:]
        want, _ = shas(tmp_path / f"{name}-per-node")
        assert len(set(want.values())) == 3
        run, staleness = CellRun(Cell(grid(load_scenario(None, scenario))[0], "trimmed-mean", "none", 0), False), []
        while not run.engine.done and (record := run.play_round()) is not None:
            staleness += record["staleness"].values()
        assert max(staleness) >= 1, name  # the slow node's rows came stale: the schedule matters
        flower = bench(tmp_path / f"{name}-flower", scenario, "--engine", "flower", home=home)
        assert flower.returncode == 0, flower.stderr[-3000:]
        assert shas(tmp_path / f"{name}-flower")[0] == want, name  # the same loop, on the local driver's clock

    # real processes run on the wall: their buffers follow real arrival times (see the README)
    deploy = bench(tmp_path / "deploy", TIMED + ["round=async", "rounds=1", 'attacks=["none"]'], "--engine", "deploy",
                   home=home)
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    _, rows = shas(tmp_path / "deploy")
    assert rows[0]["engine"] == "deploy" and len(rows[0]["accuracy"]) == 2  # two buffers of 3 of the 4 nodes


def test_drivers_refuse_what_they_cannot_run(tmp_path):
    for engine, extra, words in [("flower", ["--jobs", "2"], "drop --jobs"), ("deploy", [], "node-side attacks only"),
                                 ("flower", ["--no-vectorize"], "--no-vectorize is a mode of --engine local")]:
        run = bench(tmp_path / engine, GRID, "--engine", engine, *extra, home=tmp_path / "home")
        assert run.returncode == 2 and words in run.stderr and "Traceback" not in run.stderr, run.stderr
