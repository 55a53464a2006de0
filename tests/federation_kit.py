"""Helpers for the federation tests: folders made with the real commands, and an in-process
federation that runs the coordinator's and volunteers' exact functions (no Flower), used as
the reference the deployed runs must match bit for bit."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import torch

from flwr.app import RecordDict

from nodes import checkpoint, commands
from nodes.coordinator.coordinator import Coordinator
from nodes.engine.inbox import Inbox
from nodes.engine.ledger import ttl
from nodes.engine.training import NodeData
from nodes.settings import Settings
from nodes.volunteer import faults, volunteer
from nodes.volunteer.volunteer import work
from robust import keys


def make_federation(root: Path, n: int, settings: Settings, seed: int = 0) -> tuple[Path, list[Path]]:
    """A coordinator folder with ``n`` admitted volunteers holding their data, keys derived from ``seed``."""
    coord, nodes = commands.local_federation(root, n, settings, f"test-{seed}", ("test", seed))
    for i, folder in enumerate(nodes, start=1):
        volunteer.prepare_data(folder, settings.dataset, settings.data_root or None, f"{i}/{n}")
    return coord, nodes


def fingerprint(node: Path) -> str:
    return keys.fingerprint(keys.load_private(node).public_key())


HANDLES = itertools.count()  # an in-process transport's names for its tasks


def ask(coord: Coordinator, fps: list[str]) -> tuple[dict, object]:
    """The coordinator's tasks for ``fps``, each out at once (an in-process transport)."""
    tasks, w = coord.tasks(fps)
    for fp, task in tasks.items():
        coord.ledger.issue(fp, task.round, coord.round, task.base, coord.model(), 0.0, ttl(coord.settings.deadline),
                           next(HANDLES))
    return tasks, w


def withdraw(coord: Coordinator, fp: str) -> None:
    """``fp``'s task out, if any, is no longer out."""
    ticket = coord.ledger.task_of(fp)
    if ticket is not None:
        coord.ledger.close(ticket.handle)


def file(coord: Coordinator, fp: str, content: RecordDict | None, inbox: Inbox, error: str = "",
         waited: float | None = None) -> bool:
    """File ``content`` (or the transport's ``error``) as the reply to ``fp``'s task out, as
    the serve loop does (``nodes.engine.serve``): a quarantined node's is not read; any other
    closes its task whatever it holds, then is filed."""
    ticket = coord.ledger.task_of(fp)
    if not coord.ledger.reads(ticket):
        return False
    coord.ledger.close(ticket.handle)
    return coord.file(ticket, content, error, inbox, waited)


def replies(coord: Coordinator, nodes: list[Path], attacks: dict[int, str] | None = None) -> list[tuple[str, RecordDict]]:
    """Every node's reply to this round's task, issued to it now (:func:`ask`, in place
    of any task it had out), as it goes on the wire: ``(fp, content)``."""
    for node in nodes:
        withdraw(coord, fingerprint(node))
    tasks, w = ask(coord, [fingerprint(node) for node in nodes])
    out = []
    for i, node in enumerate(nodes, start=1):
        attack, task = (attacks or {}).get(i, ""), tasks[fingerprint(node)]
        part = next(node.glob("data-*.pt"))
        index, total = part.stem.rsplit("-", 1)[1].split("of")
        reply, row = work(task, w, NodeData.load(part), keys.load_private(node), torch.device("cpu"), attack, node,
                          f"{index}/{total}")
        out.append((fingerprint(node), faults.content(attack, reply, row)))
    return out


def take(coord: Coordinator, fp: str, content: RecordDict, inbox: Inbox) -> None:
    """File ``content`` as ``fp``'s reply to this round's task, issued to it now (an in-process
    transport; a node already in ``inbox`` is not read again)."""
    if fp not in inbox:
        withdraw(coord, fp)
        ask(coord, [fp])
        file(coord, fp, content, inbox)


def play(coord: Coordinator, nodes: list[Path], attacks: dict[int, str] | None = None, shuffle: int | None = None,
         checkers=None) -> dict:
    """One round in-process: every selected node replies (in a shuffled order if asked);
    ``checkers`` (``nodes.coordinator.verifier.Checkers``) answer the round's spot checks."""
    asked = coord.select([fingerprint(n) for n in nodes])
    got = [r for r in replies(coord, nodes, attacks) if r[0] in asked]
    for fp in {t.node for t in coord.ledger} - set(asked):  # the nodes not asked have no task out
        withdraw(coord, fp)
    if shuffle is not None:
        random.Random(shuffle).shuffle(got)
    inbox = Inbox()
    for fp, content in got:
        file(coord, fp, content, inbox)
    return coord.finish_round(asked, inbox, 0.0, checkers)


def reference_sha256(root: Path, n: int, settings: Settings) -> str:
    """The ``model_sha256`` of the federation of ``n`` nodes under ``settings`` played to its end
    in-process, every reply in order: what a deployment of the same federation must reach."""
    folder, nodes = make_federation(root, n, settings)
    coord = Coordinator(folder)
    while not coord.done:
        play(coord, nodes)
    return json.loads((folder / checkpoint.RESULT).read_text())["model_sha256"]
