"""``robust bench --engine flower``: benchmark cells through Flower's simulation engine.

Each simulated SuperNode is one node of the scenario (its ``partition-id`` is the node
index). Its ClientApp computes its row with ``CellRun.node_row``, exactly as the local
engine's per-node mode does, and keeps its worker momentum in its own ``context.state``
between rounds. The ServerApp runs the cells one after another on its own round loop
(``Grid.push_messages`` / ``pull_messages``): it sends the global model, puts the replies in
node order, whatever order they arrived in, and hands them to ``CellRun.finish_round``
(omniscient attack, validation, canonical order, aggregation, detectors, evaluation). So a
cell ends with the same ``model_sha256`` as ``robust bench --no-vectorize``
(``tests/test_flower_engine.py``).

One simulation (Ray start-up: about 10 s here) serves every cell with the same number of
nodes; a node resets its momentum when a cell's round 0 arrives.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from .engine import Cell, CellRun
from .scenario import cell_id

POLL_SECONDS = 0.01  # the in-memory simulation answers in milliseconds
WAIT_SECONDS = 600.0  # for the nodes to start, and for one round: then the run fails, loudly


_BUILT: dict[str, CellRun] = {}  # per process (Ray actor): the cell its nodes work on now


def cell_run(cell: Cell) -> CellRun:
    """The cell built once per process, not per message (a module function: Ray's pickling
    sends it by reference, so the cache lives in the actor)."""
    key = cell_id(cell)
    if key not in _BUILT:
        _BUILT.clear()
        _BUILT[key] = CellRun(cell, vectorize=False)
    return _BUILT[key]


def client_app(cells: dict[str, Cell]) -> ClientApp:
    """The simulated volunteers of ``cells`` (by id): a train message names a cell and a round."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        config = msg.content["config"]
        key, t = str(config["cell"]), int(config["round"])
        run, i = cell_run(cells[key]), int(context.node_config["partition-id"])
        w = msg.content["arrays"].to_torch_state_dict()["w"]
        state = context.state.get("momentum")
        m = state.to_torch_state_dict()["m"] if t > 0 and state is not None else torch.zeros_like(w)
        row, m = run.node_row(i, t, w, m)
        context.state["momentum"] = ArrayRecord({"m": m})
        return Message(RecordDict({"arrays": ArrayRecord({"row": row}), "node": MetricRecord({"index": i})}), reply_to=msg)

    return app


def server_app(cells: dict[str, Cell], save: Callable[[Cell, dict], None]) -> ServerApp:
    """Runs every cell of ``cells`` to its end, calling ``save(cell, record)`` after each."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        n = int(next(iter(cells.values())).config["nodes"])
        until = time.monotonic() + WAIT_SECONDS
        while len(nodes := sorted(grid.get_node_ids())) < n:  # simulated nodes register after we start
            if time.monotonic() > until:
                raise RuntimeError(f"only {len(nodes)} of {n} simulated nodes started in {WAIT_SECONDS:.0f} s")
            time.sleep(POLL_SECONDS)
        for key, cell in cells.items():
            run, start = CellRun(cell, vectorize=False), time.perf_counter()
            for t in range(run.rounds):
                rows = exchange(grid, nodes, run.w, key, t)
                run.finish_round(t, torch.stack([rows[i] for i in range(run.n)]))
            record = run.record(time.perf_counter() - start, training=0.0)
            save(cell, {**record, "engine": "flower"})

    return app


def exchange(grid: Grid, nodes: list[int], w: torch.Tensor, key: str, t: int) -> dict[int, torch.Tensor]:
    """Send round ``t`` of cell ``key`` with model ``w`` to every node; their rows by node index."""
    messages = [
        Message(RecordDict({"arrays": ArrayRecord({"w": w}), "config": ConfigRecord({"cell": key, "round": t})}),
                dst_node_id=node, message_type="train", group_id=f"{key}/{t}")
        for node in nodes
    ]
    pending = set(grid.push_messages(messages))
    rows: dict[int, torch.Tensor] = {}
    until = time.monotonic() + WAIT_SECONDS
    while pending:
        if time.monotonic() > until:
            raise RuntimeError(f"{len(pending)} simulated node(s) did not answer round {t} in {WAIT_SECONDS:.0f} s")
        for reply in grid.pull_messages(pending):
            pending.discard(reply.metadata.reply_to_message_id)
            if reply.has_error():  # a simulated node crashed: the cell cannot match the local engine
                raise RuntimeError(f"a simulated node failed in round {t}: {reply.error.reason}")
            rows[int(reply.content["node"]["index"])] = reply.content["arrays"].to_torch_state_dict()["row"]
        if pending:
            time.sleep(POLL_SECONDS)
    return rows


def run_cells(todo: list[Cell], save: Callable[[Cell, dict], None]) -> None:
    """Run ``todo`` through Flower's simulation engine, one simulation per node count."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a FutureWarning
    try:
        from flwr.simulation import run_simulation  # imports Ray: only when this engine runs
        import ray  # noqa: F401
    except ImportError as err:
        raise RuntimeError(f"--engine flower needs Flower's simulation extra ({err}): pip install -e '.[simulation]'") from err
    logging.getLogger("flwr").addFilter(lambda record: "run_simulation" not in record.getMessage())

    by_nodes: dict[int, dict[str, Cell]] = {}
    for cell in todo:
        by_nodes.setdefault(int(cell.config["nodes"]), {})[cell_id(cell)] = cell
    for n, cells in by_nodes.items():
        run_simulation(
            server_app=server_app(cells, save), client_app=client_app(cells), num_supernodes=n,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {
                    "num_cpus": os.cpu_count() or 1, "include_dashboard": False, "logging_level": "ERROR",
                    "log_to_driver": False,  # a node's failure reaches the ServerApp as an error reply
                },
            },
        )
