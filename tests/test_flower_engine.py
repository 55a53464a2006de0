"""``robust bench --engine flower``: the scenario runs through Flower's simulation engine
(Ray actors as SuperNodes, the ServerApp's own round loop) and every cell ends with the same
model bits as the local engine's per-node mode."""

import json
import os
import subprocess
import sys

SCENARIO = [
    "rounds=3", "nodes=6", "byzantine=1", "seeds=[0, 1]", "dataset=synthetic", "model=mlp",
    "momentum=0.9", 'aggregators=["trimmed-mean", "bucketing:s=2+centered-clipping:tau=10,iters=3"]',
    'attacks=["alie", "label-flip"]',
]


def bench(out, *extra, home):
    cmd = [sys.executable, "-m", "robust.cli", "bench", "--out", str(out), *extra]
    for item in SCENARIO:
        cmd += ["--set", item]
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def shas(out):
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {(r["aggregator"], r["attack"], r["seed"]): r["model_sha256"] for r in rows}, rows


def test_flower_engine_matches_the_per_node_mode(tmp_path):
    flower = bench(tmp_path / "flower", "--engine", "flower", home=tmp_path / "home")
    assert flower.returncode == 0, flower.stderr[-3000:]
    assert "Flower simulation engine" in flower.stderr and "report:" in flower.stdout
    per_node = bench(tmp_path / "per-node", "--no-vectorize", home=tmp_path / "home")
    assert per_node.returncode == 0, per_node.stderr[-3000:]
    got, rows = shas(tmp_path / "flower")
    want, _ = shas(tmp_path / "per-node")
    assert len(got) == 8 and got == want
    assert all(r["engine"] == "flower" and len(r["accuracy"]) == 3 for r in rows)
    assert len(set(got.values())) == 8  # every cell trained a different model
    again = bench(tmp_path / "flower", "--engine", "flower", home=tmp_path / "home")
    assert again.returncode == 0 and "8 cells (8 already in" in again.stderr  # nothing runs twice


def test_flower_engine_refuses_parallel_jobs(tmp_path):
    run = bench(tmp_path / "out", "--engine", "flower", "--jobs", "2", home=tmp_path / "home")
    assert run.returncode == 2 and "drop --jobs" in run.stderr and "Traceback" not in run.stderr
