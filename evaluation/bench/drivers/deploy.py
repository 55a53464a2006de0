"""``robust bench --engine deploy``: each cell through the real thing, on loopback.

A cell becomes a federation on disk (``evaluation.bench.drivers.federation``), then runs exactly as a user
runs one: ``robust coordinator start``'s own code starts a SuperLink (TLS, node
authentication), submits the coordinator's ServerApp, and each node runs its warm trainer and
a SuperNode, whose thin ClientApp (a fresh process per task) hands the trainer its tasks:
signed replies; each node's processes at its compute profile (``profiles``, given to the nodes in
turn). The cell's record comes from the coordinator's round log and checkpoint. Only
node-side attacks can be played (volunteers run them); the threat model's measurements that
need every honest row (``kappa``) are left empty. A small cell gives the same
``model_sha256`` as the per-node local driver (``tests/test_drivers.py``), whatever ``PATH``
and thread count it is started with. Each round costs seconds (Flower polls every 3 s): keep
such cells small.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from nodes import commands, launch
from robust import tls

from . import federation
from evaluation.bench.cell import Cell, CellSetup, cell_record

DEADLINE = 600.0  # seconds a round waits: nodes are local, so only a broken one is late


def run_cell(cell: Cell, root: Path) -> dict:
    """The cell's record, from its federation in ``root/<run id>`` (removed once done)."""
    setup = CellSetup(cell)
    folder = root.resolve() / federation.run_id(setup)
    shutil.rmtree(folder, ignore_errors=True)  # a run killed mid-cell left it behind
    port = launch.free_port()
    coord, nodes = federation.build(setup, folder, port=port, deadline=DEADLINE, wait_nodes=DEADLINE)
    procs = []

    def start_nodes() -> None:  # each at its compute profile (``profiles``)
        for node, fp in zip(nodes, setup.by_index):
            procs.extend(launch.start_node(node, f"127.0.0.1:{port}", coord / "tls" / tls.CA_CERT,
                                           setup.profile_of(fp).prefix()))

    log = folder / "coordinator.log"
    start = time.perf_counter()
    try:
        with open(log, "w") as out, contextlib.redirect_stdout(out):
            code = commands.coordinator_start(coord, {}, on_ready=start_nodes)
    finally:
        for proc in procs:
            launch.stop(proc)
    wall = time.perf_counter() - start
    if code == 130:
        raise KeyboardInterrupt
    if code != 0:
        raise RuntimeError(f"the coordinator of cell {cell.aggregator} vs {cell.attack} (seed {cell.seed}) "
                           f"failed with exit code {code}: see {log}")
    rounds, w = federation.rounds_and_model(coord)
    federation.check_complete(rounds, folder)
    record = cell_record(setup, rounds, w, None, wall, None, "deploy", kept=federation.memories(setup, nodes))
    shutil.rmtree(folder, ignore_errors=True)
    return record


def run_cells(todo: list[Cell], root: Path, save: Callable[[Cell, dict], None]) -> None:
    """Run ``todo`` one cell at a time, each through its own SuperLink and SuperNodes."""
    for cell in todo:
        save(cell, run_cell(cell, root))
