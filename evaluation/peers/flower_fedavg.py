"""Flower's own FedAvg strategy (``Strategy.start``) on the same volunteers, data and model:
the baseline beside which ``robust deploy-bench`` reports the deployment's round overhead.

The ClientApp trains exactly as a robust volunteer does (:func:`nodes.engine.training.compute`,
the ``delta`` protocol) and returns weights, as FedAvg expects; the ServerApp records, per round, the wall time and
the slowest node's training time (from the replies' metrics), and evaluates centrally, as
the robust coordinator does. Results go to ``<state-dir>/fedavg.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from nodes.engine.protocol import Protocol
from nodes.engine.training import NodeData, compute
from nodes.settings import Settings
from nodes.volunteer.volunteer import NodeConfig, pick_device
from nodes.wire import Task
from robust import keys
from robust.data import load
from robust.models import Scorer, build_model
from robust.params import flat_params, unflatten

RESULT = "fedavg.json"
server = ServerApp()
client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    folder = Path(str(context.node_config["folder"]))
    data = NodeData.load(Path(NodeConfig.load(folder).data))
    model = build_model(str(config["model"]), tuple(data.x.shape[1:]), data.classes)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    w = flat_params(model)
    start = time.perf_counter()
    task = Task(run="fedavg", round=int(config["server-round"]), base="", seed=int(config["seed"]),
                dataset=data.dataset, model=str(config["model"]), protocol=str(config["protocol"]),
                batch_size=int(config["batch-size"]), lr=float(config["lr"]), momentum=float(config["momentum"]),
                threads=int(config["threads"]), deadline=0.0)
    node = keys.fingerprint(keys.load_private(folder).public_key())
    delta, _ = compute(task, w, data.x, data.y, data.classes, node, pick_device("auto"))
    seconds = time.perf_counter() - start
    state = {k: v.clone() for k, v in unflatten(w + delta, model).items()}
    return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(
        {"num-examples": len(data.y), "train-seconds": seconds})}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    folder = Path(str(context.run_config["state-dir"]))
    s = Settings.read(folder)
    protocol = Protocol.of(s)
    if protocol.kind != "delta" or protocol.server_momentum or protocol.server_lr != 1.0:
        raise ValueError(f"FedAvg applies the mean of model deltas as they are: protocol {s.protocol!r} is not "
                         "that; run deploy-bench with plain delta:steps=K")
    nodes = int(context.run_config["nodes"])
    data = load(s.dataset, root=s.data_root or None, seed=0)
    model = build_model(s.model, data.shape, data.classes, s.seed)
    scorer = Scorer(model)
    marks, slowest, accuracies = [time.monotonic()], [], []

    def aggregate_train_metrics(records: list[RecordDict], key: str) -> MetricRecord:
        slowest.append(max(float(r["metrics"]["train-seconds"]) for r in records))
        marks.append(time.monotonic())
        return aggregate_metricrecords(records, key)

    def evaluate(round_: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        accuracies.append(scorer(flat_params(model), data.x_test, data.y_test))
        return MetricRecord({"accuracy": accuracies[-1]})

    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes,
                      train_metrics_aggr_fn=aggregate_train_metrics)
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=s.rounds, timeout=s.deadline,
                   train_config=ConfigRecord({"model": s.model, "seed": s.seed, "protocol": s.protocol,
                                              "batch-size": s.batch_size, "lr": s.lr, "momentum": s.momentum,
                                              "threads": s.threads}),
                   evaluate_fn=evaluate)
    rounds = [{"round": i + 1, "seconds": marks[i + 1] - marks[i], "train_seconds_max": slowest[i]}
              for i in range(len(slowest))]
    (folder / RESULT).write_text(json.dumps({"rounds": rounds, "accuracy": accuracies}, indent=1) + "\n")
