"""``robust bench --engine flower``: cells through Flower's simulation engine, on the product's apps.

Each simulated SuperNode is one node of the cell: the ClientApp is the volunteer's own
(``nodes.volunteer.client_app.make_app``: the in-process one, with no warm trainer process; it
answers with the function the deployed volunteer's trainer calls), working in the node folder the cell's federation gives it
(``evaluation.bench.drivers.federation``), keeping its worker momentum there. The ServerApp runs the
coordinator's own round loop (``nodes.coordinator.server_app.serve``) on a :class:`Coordinator` whose
engine carries the threat model's hook (``evaluation.bench.threat``): signed replies, checks,
canonical order, the round engine. Simulated nodes have no authenticated key, so they
introduce themselves (their signatures prove it). A cell ends with the same
``model_sha256`` as ``robust bench --no-vectorize`` (``tests/test_drivers.py``): a cell with a
schedule (``round = async``, or a ``deadline``, with ``late = carry`` or not) runs the loop on
the local driver's simulated clock (``evaluation.simtime.serve_clock``), so its buffers, late and carried
replies are the local driver's.

One simulation (Ray start-up: about 10 s here) serves every cell with the same number of
nodes. A node whose ClientApp fails (Flower reports it at once) or that does not answer
within ``WAIT_SECONDS`` fails the run when its cell ends, naming the node and the round.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from nodes.coordinator.coordinator import Coordinator
from nodes.coordinator.server_app import serve
from nodes.launch import free_port
from nodes.volunteer.client_app import make_app

from . import federation
from evaluation.bench.cell import Cell, CellSetup, cell_record
from evaluation.simtime.serve_clock import SimClock
from evaluation.bench.threat import ThreatModel
from evaluation.simtime.timeline import Timeline

POLL_SECONDS = 0.01  # the in-memory simulation answers in milliseconds
WAIT_SECONDS = 600.0  # for the nodes to start, and for one round: then the run fails, loudly
# in-flight: no window. The simulated clock foresees each round's replies from the local driver's
# schedule, every task leaving when its round starts; the simulation holds every row in memory anyway.
NO_WINDOW = 2**62


class SimulatedFolders:
    """Where simulated node ``partition-id`` keeps its files in run ``run``: ``root/run/node<id+1>``
    (a class, not a closure: Ray pickles it into its actors)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, context: Context, run: str) -> Path:
        return self.root / run / f"node{int(context.node_config['partition-id']) + 1}"


def server_app(cells: list[Cell], root: Path, save: Callable[[Cell, dict], None]) -> ServerApp:
    """Runs every cell of ``cells`` to its end, calling ``save(cell, record)`` after each."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for cell in cells:
            setup = CellSetup(cell)
            folder = root / federation.run_id(setup)
            shutil.rmtree(folder, ignore_errors=True)  # a run killed mid-cell left it behind
            coord_dir, nodes = federation.build(setup, folder, port=free_port(), deadline=WAIT_SECONDS,
                                                wait_nodes=WAIT_SECONDS, in_flight=NO_WINDOW)
            threat = ThreatModel(cell.attack, setup.byzantine, cell.seed)
            coord, start = Coordinator(coord_dir, hook=threat), time.perf_counter()
            clock = clock_of(setup, coord)
            serve(grid, coord, poll=POLL_SECONDS, introductions=True, clock=clock)
            wall = time.perf_counter() - start
            rounds, w = federation.rounds_and_model(coord_dir)
            federation.check_complete(rounds, folder, scheduled=clock is not None)
            save(cell, cell_record(setup, rounds, w, threat.kappa, wall, None, "flower",
                                   kept=federation.memories(setup, nodes)))
            shutil.rmtree(folder, ignore_errors=True)

    return app


def clock_of(setup: CellSetup, coord: Coordinator) -> SimClock | None:
    """The local driver's simulated clock, for a cell whose schedule depends on time (async,
    or a deadline); ``None``: the wall (every reply counts, in any order)."""
    line = Timeline(setup.cell.config, setup.ids, setup.cell.seed, setup.settings, coord.engine.protocol.steps,
                    coord.engine.w.numel())
    asynchronous = setup.settings.round == "async"
    return SimClock(line, asynchronous, setup.settings.deadline) if asynchronous or line.deadline else None


def run_cells(todo: list[Cell], root: Path, save: Callable[[Cell, dict], None]) -> None:
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
    root = root.resolve()
    by_nodes: dict[int, list[Cell]] = {}
    for cell in todo:
        by_nodes.setdefault(int(cell.config["nodes"]), []).append(cell)
    for n, cells in by_nodes.items():  # a ServerApp's exception ends run_simulation with it
        run_simulation(
            server_app=server_app(cells, root, save), client_app=make_app(SimulatedFolders(root)), num_supernodes=n,
            backend_config={
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                "init_args": {
                    "num_cpus": os.cpu_count() or 1, "include_dashboard": False, "logging_level": "ERROR",
                    "log_to_driver": False,
                },
            },
        )
