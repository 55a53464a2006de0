"""``robust bench --cluster ray`` on a real Ray cluster on loopback: a head and two worker
nodes (Ray's ``cluster_utils.Cluster``, each node its own GCS client, raylet and worker
processes), every address 127.0.0.1; the bench runs as its own process, as a user runs it."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.test_bench import records

pytest.importorskip("ray")

# 50 rounds: a cell lasts about 0.1 s here, long enough for the test to see one running on a node
GRID = [
    "rounds=50", "nodes=7", "byzantine=1", "seeds=[0,1]", "dataset=synthetic", "model=logreg", "protocol=momentum",
    'aggregators=["mean","trimmed-mean"]', 'attacks=["none","alie","label-flip","sign-flip","ipm"]',
]


def bench_cmd(out, *extra):
    cmd = [sys.executable, "-m", "robust.cli", "bench", "--out", str(out)]
    for item in GRID:
        cmd += ["--set", item]
    return cmd + list(extra)


def bench(out, *extra, env=None):
    return subprocess.run(bench_cmd(out, *extra), capture_output=True, text=True, timeout=600, env=env)


def started(out, *extra, env=None) -> subprocess.Popen:
    """``bench`` in the background (``finish`` waits for it)."""
    return subprocess.Popen(bench_cmd(out, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    """What ``bench`` returns, for a run ``started``."""
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def local_grid(tmp_path):
    """The grid with ``--jobs 1`` in ``tmp_path/local`` (the reference bits), started before the
    ``cluster`` fixture so that it computes while the cluster's nodes start: a function that
    waits for it and returns what ``bench`` returns."""
    proc = started(tmp_path / "local", "--jobs", "1")
    try:
        yield lambda: finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def cluster(monkeypatch):
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    loopback = {"node_ip_address": "127.0.0.1", "temp_dir": temp}
    # Ray notes the head's address in RAY_TMPDIR/ray (default /tmp/ray, absent on a fresh machine)
    os.makedirs(os.path.join(temp, "ray"))
    monkeypatch.setenv("RAY_TMPDIR", temp)
    # the cluster's own processes (its Ray Client server among them) keep to 127.0.0.1; the
    # bench's driver is not told: it must keep to loopback by itself
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    client_port = free_port()
    head = Cluster()
    try:
        head.add_node(**loopback, num_cpus=0, include_dashboard=False, ray_client_server_port=client_port)
        workers = [head.add_node(**loopback, num_cpus=1) for _ in range(2)]
        monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        yield head, workers, client_port
    finally:
        head.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def client_server_logs(head) -> str:
    """The end of each Ray Client server's error log (the cluster's folder goes with it)."""
    logs = sorted(Path(head.head_node.get_logs_dir_path()).glob("ray_client_server*.err"))
    return "".join(f"\n--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)


def _running_a_cell(node) -> bool:
    """Whether one of ``node``'s worker processes is inside a cell (Ray names it after the task)."""
    raylet = node.all_processes["raylet"][0].process.pid
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            title = (proc / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == raylet and title.startswith(b"ray::_task"):
            return True
    return False


def test_a_grid_on_a_loopback_cluster_survives_a_dead_node_with_local_bits(tmp_path, local_grid, cluster):
    head, (doomed, survivor), client_port = cluster
    local = local_grid()
    assert local.returncode == 0, local.stderr
    env = {**os.environ, "RAY_ADDRESS": head.address}
    assert head.address.startswith("127.0.0.1:")

    out = tmp_path / "ray"
    run = subprocess.Popen([sys.executable, "-m", "robust.cli", "bench", "--out", str(out), "--cluster", "ray",
                            *[a for item in GRID for a in ("--set", item)]],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while not _running_a_cell(doomed):  # kill the node while a cell runs on it
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.005)
    head.remove_node(doomed, allow_graceful=False)
    stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr

    assert {r["cell"]: r["model_sha256"] for r in records(out)} == {
        r["cell"]: r["model_sha256"] for r in records(tmp_path / "local")}
    assert len(records(out)) == 20 and "report:" in stdout
    last = stderr.strip().splitlines()[-1]  # a pipe: one plain line per cell, with the cells per node
    assert last.startswith("20/20 cells") and "| per node: 127.0.0.1/" in last
    nodes = dict(part.rsplit(" ", 1) for part in last.split("| per node: ")[1].split(", "))
    assert f"127.0.0.1/{survivor.node_id[:6]}" in nodes and sum(map(int, nodes.values())) == 20

    again = bench(out, "--cluster", "ray", env=env)  # finished cells are skipped, as locally
    assert again.returncode == 0 and "20 cells (20 already in" in again.stderr and len(records(out)) == 20

    client = tmp_path / "client"  # through Ray Client, as from a laptop: two of the cells
    done = bench(client, "--cluster", f"ray://127.0.0.1:{client_port}", "--set", 'aggregators=["mean"]',
                 "--set", 'attacks=["alie"]')
    assert done.returncode == 0, done.stderr + client_server_logs(head)
    local = {r["cell"]: r["model_sha256"] for r in records(tmp_path / "local")}
    assert {r["cell"]: r["model_sha256"] for r in records(client)}.items() < local.items()


def test_cluster_refusals_say_what_to_do(tmp_path):
    refusals = [(["--cluster", "slurm"], "--cluster must be ray or ray://HOST:PORT"),
                (["--cluster", "ray", "--jobs", "2"], "drop --jobs"),
                (["--cluster", "ray", "--engine", "flower"], "drop --engine flower")]
    runs = [started(tmp_path / "x", *extra) for extra, _ in refusals]  # side by side, each its own process
    # nothing listens there: a clear failure, not a hang
    unreachable = started(tmp_path / "y", "--cluster", "ray", env={**os.environ, "RAY_ADDRESS": "127.0.0.1:9"})
    outcomes = [finish(run) for run in runs]
    done = finish(unreachable)
    for refused, (_, words) in zip(outcomes, refusals):
        assert refused.returncode == 2 and words in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert done.returncode == 1 and "no Ray cluster at 127.0.0.1:9" in done.stderr, done.stderr
