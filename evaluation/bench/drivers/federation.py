"""A cell as a federation on disk, for the drivers that run the coordinator's own apps.

:func:`build` makes what ``robust coordinator init``, ``node keygen`` and ``coordinator
admit`` make (``nodes.commands.local_federation``), with the cell's node keys: a coordinator
folder holding the cell's settings, and one folder per node holding its key, its part of
the training set and its ``node.json`` (a Byzantine node's node-side attack; the part it
declares with each update, ``I/N;KIND:alpha=A,seed=S``, from which a spot check recomputes it).
Nodes compute on the CPU, as the per-node local driver does, so the bits can be compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from nodes import checkpoint, codetrust, launch
from nodes.commands import local_federation
from nodes.engine.training import NodeData, part_spec
from attacks.base import Memory
from nodes.volunteer.volunteer import NodeConfig, last_kept

from evaluation.bench.cell import KEY_SEED, CellSetup, cell_settings
from evaluation.bench.scenario import cell_id
from evaluation.simtime.serve_clock import LATE


def run_id(setup: CellSetup) -> str:
    return f"bench-{cell_id(setup.cell)}"


def build(setup: CellSetup, root: Path, **deployment: object) -> tuple[Path, list[Path]]:
    """The coordinator folder and the node folders (node ``i`` is ``root/node<i>``)."""
    settings = cell_settings(setup.cell, **deployment)
    coord, folders = local_federation(root, setup.n, settings, run_id(setup), (KEY_SEED, setup.cell.seed))
    data = setup.data
    bundle = (coord / launch.CODE_SHA).read_text().strip() if settings.code else ""
    cfg = setup.cell.config
    for i, (folder, fp) in enumerate(zip(folders, setup.by_index), start=1):
        part = setup.parts[fp]
        path = folder / "data.pt"
        NodeData(data.name, data.x_train[part].clone(), data.y_train[part].clone(), data.classes,
                 data.sha256).save(path)
        device = "cuda" if setup.profile_of(fp).kind == "cuda" else "cpu"
        declared = part_spec(i, setup.n, cfg["partition"], float(cfg["alpha"]), setup.cell.seed)  # what a check recomputes from
        NodeConfig(str(path.resolve()), device, setup.attack_of(fp), part=declared, code=settings.code).save(folder)
        if bundle:  # the bench's own code: its nodes accept it
            codetrust.trust(folder, bundle)
    return coord, folders


def memories(setup: CellSetup, folders: list[Path]) -> list[Memory]:
    """What the Byzantine nodes (canonical order) kept of their last rounds in their ``folders``
    (node ``i``'s is ``folders[i - 1]``): the triggers an adaptive backdoor's success is measured with."""
    kept = (last_kept(folders[setup.by_index.index(fp)], run_id(setup)) for fp in sorted(setup.byzantine))
    return [m for m in kept if m is not None]


def rounds_and_model(coord: Path) -> tuple[list[dict], torch.Tensor]:
    """The engine's records of a finished run, and its final model."""
    rounds = [json.loads(line) for line in (coord / checkpoint.ROUNDS).read_text().splitlines()]
    return rounds, checkpoint.load(coord)["engine"]["w"]


def check_complete(rounds: list[dict], where: Path, scheduled: bool = False) -> None:
    """A bench cell must hear every node every round: a lost reply is a failure, loudly. On a
    simulated schedule (``scheduled``) a node without a reply was late by that schedule (the
    clock's ``late: ...``), as in the local driver."""
    for r in rounds:
        lost = {node: why for node, why in r["failed"].items() if not (scheduled and why.startswith(LATE))}
        if not scheduled:
            lost.update({m: "no reply before the deadline" for m in r["missing"]})
        if lost:
            node, reason = next(iter(lost.items()))
            raise RuntimeError(f"round {r['round']}: node {node[:12]} failed ({reason}); the cell cannot match the "
                               f"local driver: see {where}")
