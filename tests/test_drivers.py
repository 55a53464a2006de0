"""One engine, three drivers: a bench cell computed node by node in-process, through Flower's
simulation engine (the coordinator's own ServerApp and ClientApp) and through real
SuperLink/SuperNode processes on loopback ends with the same model bits. Neurotoxin's nodes
keep the model they were last sent in their folders (its mask in round 2): the per-node
driver's memory, bit for bit."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from nodes import launch

# quarantine at the first flag: nodes are quarantined in a few cells, and an `inf` node in
# every one of its cells, leaving 2 nodes where the quorum is 3 (the round skips at once)
BASE = ["rounds=2", "nodes=3", "byzantine=1", "dataset=digits", "model=mlp", "protocol=momentum", "quarantine-after=1"]
GRID = BASE + ["seeds=[0, 1]", 'aggregators=["trimmed-mean", "bucketing:s=2+centered-clipping:tau=10,iters=3"]',
               'attacks=["none", "alie:z=1", "label-flip", "inf", "neurotoxin:k=5"]']
# one deployed cell (each starts its own SuperLink, SuperNodes and trainers: half a minute): its
# honest nodes train as in a clean cell, and its Byzantine node flips its labels on its side
NODE_SIDE = BASE + ["seeds=[0]", 'aggregators=["trimmed-mean"]', 'attacks=["label-flip"]']


def _bench_args(out, scenario, extra, home, env, command):
    cmd = [*command, "bench", "--out", str(out), *extra]
    for item in scenario:
        cmd += ["--set", item]
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           **(env or {})}
    return cmd, env


def bench(out, scenario, *extra, home, env=None, command=(sys.executable, "-m", "robust.cli")):
    cmd, env = _bench_args(out, scenario, extra, home, env, command)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


@contextlib.contextmanager
def aside(cmd, env, logs: Path):
    """``cmd`` started in the background, its output in ``logs``.stdout and .stderr: real processes
    that mostly wait (on Flower's polls, on Ray) run while the test computes. Gives a function
    that waits for it and returns what ``subprocess.run`` would; stopped, with the processes it
    started, if the test ends first."""
    out, err = logs.with_suffix(".stdout"), logs.with_suffix(".stderr")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=env, start_new_session=True)

    def result() -> subprocess.CompletedProcess:
        proc.wait(timeout=900)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text())

    try:
        yield result
    finally:
        launch.stop(proc, grace=10)


def bench_aside(out, scenario, *extra, home, env=None, command=(sys.executable, "-m", "robust.cli")):
    """``bench`` in the background (``aside``)."""
    return aside(*_bench_args(out, scenario, extra, home, env, command), out)


def shas(out):
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {(r["aggregator"], r["attack"], r["seed"]): r["model_sha256"] for r in rows}, rows


def test_per_node_flower_and_deploy_give_the_same_bits(tmp_path):
    home = tmp_path / "home"
    # the real thing, started as a pipx or systemd user would: by absolute path, no venv on
    # PATH, and with another thread count than the reference (its bits are checked at the end)
    robust = Path(sys.executable).with_name("robust")
    with bench_aside(tmp_path / "deploy", NODE_SIDE, "--engine", "deploy", home=tmp_path / "home-deploy",
                     command=(str(robust),), env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"}) as deployed:
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

        deploy = deployed()
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    got, rows = shas(tmp_path / "deploy")
    assert got == {k: v for k, v in want.items() if k[0] == "trimmed-mean" and k[2] == 0 and k[1] == "label-flip"}
    assert len(rows) == 1 and rows[0]["engine"] == "deploy" and rows[0]["kappa"] is None


# a schedule: one node of 4 three times slower (a task takes 0.01 s, 0.03 s on it). Async:
# buffers of 3 fill without it, its replies come stale; carry: it misses each 0.02 s deadline
# and its reply counts, stale, in the next round.
TIMED = ["rounds=3", "nodes=4", "byzantine=1", "dataset=digits", "model=mlp", "protocol=momentum", "seeds=[0]",
         "step-seconds=0.01", "speed=\"slow:fraction=0.25,factor=3\"", 'aggregators=["trimmed-mean"]']
SCHEDULES = {"async": ["round=async"], "carry": ["late=carry", "deadline=0.02"]}

# `robust bench --engine flower`'s driver (the CLI around it is test_per_node_flower_and_deploy_give_the_same_bits'),
# given the cells of several scenarios: those with the same number of nodes share one simulation
# (one Ray start-up). One JSON line per cell: its scenario's index, attack and model_sha256.
FLOWER_CELLS = """\
import json, sys
from pathlib import Path
from evaluation.bench.drivers.flower_sim import run_cells
from evaluation.bench.scenario import cell_id, cells, load_scenario
todo = {cell_id(c): (i, c) for i, s in enumerate(json.loads(sys.argv[1])) for c in cells(load_scenario(None, s, "flower"))}
with open(sys.argv[2], "w") as out:
    run_cells([c for _, c in todo.values()], Path(sys.argv[3]), lambda c, r: print(json.dumps(
        [todo[cell_id(c)][0], r["attack"], r["model_sha256"], r["engine"]]), file=out, flush=True))
"""


def test_async_and_carried_cells_give_the_same_bits_through_flower_and_run_deployed(tmp_path):
    from evaluation.bench.drivers.inprocess import CellRun
    from evaluation.bench.scenario import cells, load_scenario

    home = tmp_path / "home"
    scenarios = {name: TIMED + schedule + ['attacks=["none", "alie:z=1", "label-flip"]']
                 for name, schedule in SCHEDULES.items()}
    # the Flower simulation and the deployed run (checked below) go on while this process
    # computes the reference
    flower_cells = [sys.executable, "-c", FLOWER_CELLS, json.dumps(list(scenarios.values())),
                    str(tmp_path / "flower.jsonl"), str(tmp_path / "federations")]
    flower_env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    deployed_async = TIMED + ["round=async", "rounds=1", 'attacks=["none"]']
    with aside(flower_cells, flower_env, tmp_path / "flower") as flowered, \
            bench_aside(tmp_path / "deploy", deployed_async, "--engine", "deploy",
                        home=tmp_path / "home-deploy") as deployed:
        want = {}
        for name, scenario in scenarios.items():
            for cell in cells(load_scenario(None, scenario)):  # the per-node local driver, in this process
                run, staleness = CellRun(cell, False), []
                while (record := run.play_round()) is not None:
                    staleness += record["staleness"].values()
                want[name, cell.attack] = run.record(0.0)["model_sha256"]
                if cell.attack == "none":
                    assert max(staleness) >= 1, name  # the slow node's rows came stale: the schedule matters
            assert len({want[name, a] for a in ("none", "alie:z=1", "label-flip")}) == 3, name
        flower = flowered()
        assert flower.returncode == 0, flower.stderr[-3000:]
        names = list(scenarios)
        rows = [json.loads(line) for line in (tmp_path / "flower.jsonl").read_text().splitlines()]
        assert all(engine == "flower" for *_, engine in rows)
        # the same loop, on the local driver's clock
        assert {(names[i], attack): sha for i, attack, sha, _ in rows} == want and len(rows) == len(want)

        # real processes run on the wall: their buffers follow real arrival times (see the README)
        deploy = deployed()
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    _, rows = shas(tmp_path / "deploy")
    assert rows[0]["engine"] == "deploy" and len(rows[0]["accuracy"]) == 2  # two buffers of 3 of the 4 nodes


def test_drivers_refuse_what_they_cannot_run(tmp_path, capsys):
    from robust.cli import main

    for engine, extra, words in [("flower", ["--jobs", "2"], "drop --jobs"), ("deploy", [], "node-side attacks only"),
                                 ("flower", ["--no-vectorize"], "--no-vectorize is a mode of --engine local")]:
        code = main(["bench", "--out", str(tmp_path / engine), *(f for item in GRID for f in ("--set", item)),
                     "--engine", engine, *extra])  # in this process: it refuses before anything runs
        err = capsys.readouterr().err
        assert code == 2 and words in err and "Traceback" not in err, err
        assert not (tmp_path / engine / "results.jsonl").exists()
