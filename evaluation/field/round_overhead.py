"""``robust deploy-bench``: the deployment's round overhead, beside Flower's own FedAvg.

One SuperLink (TLS, node authentication) and ``--nodes`` SuperNodes on loopback serve two
runs in turn on the same volunteers, data and model: the robust coordinator's ServerApp (its
volunteers' tasks answered by their warm trainers), then Flower's ``FedAvg`` strategy
(``evaluation/peers/flower_fedavg.py``, whose ClientApp loads PyTorch and the data every task). Per round, the overhead is the
round's wall time minus the slowest node's training time (each volunteer times its own
training); the table gives medians over the rounds after the first (the first pays for
installing the app on every node).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from nodes import checkpoint, codetrust, commands, launch
from nodes.settings import Settings
from nodes.volunteer import volunteer
from nodes.volunteer.volunteer import NodeConfig
from robust import tls

from evaluation.peers.flower_fedavg import RESULT as FEDAVG_RESULT

FEDAVG_APP = "fedavg-app"


def _wait_for(path: Path, proc, what: str, timeout: float) -> dict:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if path.exists():
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"the SuperLink exited while waiting for {what}")
        time.sleep(1.0)
    raise RuntimeError(f"no {what} after {timeout:.0f} s: see the logs in {path.parent}")


def _medians(rounds: list[dict]) -> tuple[float, float, float]:
    later = rounds[1:] or rounds
    total = statistics.median(r["seconds"] for r in later)
    train = statistics.median(r["train_seconds_max"] for r in later)
    overhead = statistics.median(r["seconds"] - r["train_seconds_max"] for r in later)
    return total, train, overhead


def main(args: argparse.Namespace) -> int:
    if args.nodes < 3 or args.rounds < 2:
        raise ValueError("deploy-bench needs --nodes >= 3 and --rounds >= 2 (the first round is a warm-up)")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="robust-deploy-bench-"))
    settings = Settings(rounds=args.rounds, model=args.model, aggregator=args.aggregator, tolerate=args.tolerate,
                        quorum=args.nodes, deadline=600.0, port=launch.free_port())
    coord, folders = commands.local_federation(root, args.nodes, settings, "deploy-bench", ("deploy-bench",))
    launch.write_app(coord / FEDAVG_APP, "evaluation.peers.flower_fedavg:server", "evaluation.peers.flower_fedavg:client", nodes=args.nodes)
    fedavg = codetrust.app_sha256(coord / FEDAVG_APP)  # another ClientApp: our volunteers must accept it
    for folder in folders:
        codetrust.trust(folder, fedavg)
    print(f"deploy-bench in {root}: {args.nodes} nodes, model {args.model}, {args.rounds} rounds per run", flush=True)
    superlink = launch.start_superlink(coord, settings.bind, settings.port)
    nodes = []
    try:
        launch.register(coord, sorted((coord / "admitted").glob("*.pub")))
        for i, folder in enumerate(folders, start=1):
            data = volunteer.prepare_data(folder, settings.dataset, None, f"{i}/{args.nodes}")
            NodeConfig(str(data.resolve())).save(folder)
            nodes.extend(launch.start_node(folder, f"127.0.0.1:{settings.port}", coord / "tls" / tls.CA_CERT))
        launch.submit_run(coord)
        _wait_for(coord / checkpoint.RESULT, superlink, "robust run result", 3600)
        ours = [json.loads(line) for line in (coord / checkpoint.ROUNDS).read_text().splitlines()]
        print("robust run done; now Flower's FedAvg on the same nodes", flush=True)
        launch.submit_run(coord, coord / FEDAVG_APP)
        theirs = _wait_for(coord / FEDAVG_RESULT, superlink, "FedAvg result", 3600)["rounds"]
    finally:
        for proc in nodes:
            launch.stop(proc)
        launch.stop(superlink)
    rows = [(f"robust ({args.aggregator}, signed, validated, checkpointed)", *_medians(ours)),
            ("Flower FedAvg (Strategy.start)", *_medians(theirs))]
    print("\n| run | round s | slowest training s | overhead s |\n|---|---|---|---|")
    for name, total, train, overhead in rows:
        print(f"| {name} | {total:.2f} | {train:.2f} | {overhead:.2f} |")
    print(f"\noverhead ratio robust / FedAvg: {rows[0][3] / rows[1][3]:.2f}x "
          f"(medians of rounds 2..{args.rounds}; files in {root})")
    if args.json:
        Path(args.json).write_text(json.dumps({"robust": ours, "fedavg": theirs}, indent=1) + "\n")
    return 0
