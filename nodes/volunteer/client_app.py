"""A volunteer's answer to a task (:func:`answer`: decode, :func:`nodes.volunteer.volunteer.work`,
reply), and the in-process ClientApp that gives it (:func:`make_app`).

:func:`answer` is the one way a task is answered. A deployed volunteer's warm trainer
(``nodes.volunteer.trainer``) calls it with the node it loaded once; the bench's Flower
simulation runs it in-process, in the ClientApp :func:`make_app` builds (no trainer process),
finding each simulated node's folder from its partition id; so does a deployed volunteer's thin
ClientApp (``nodes.volunteer.thin_app``) for a task on the user's own model or data set.

A node is a folder: its key, its prepared data and ``node.json`` (device, and for Byzantine
test nodes an attack), written by ``robust node join``.

A spot-check task (``nodes.engine.spotcheck``) is answered by recomputing the named node's update on
its part of the data set (prepared in this node's folder the first time), honestly.

The update travels as the task's codec encodes it (``nodes.volunteer.volunteer.work``). A test node
that lies about its update's bytes (``dtype-lie``, ``shape-lie``, ``oversize``) tells the
same lie about the first array of a compressed update (:func:`content`).

Each answered task, its own work or a spot check, is one line of ``DIR/work.jsonl``
(``nodes.volunteer.worklog``): what ``robust node join`` shows its volunteer.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from robust import keys
from robust.user_code import use_path

from ..engine.protocol import Protocol
from ..engine.training import NodeData
from ..wire import (UPDATE, Reply, claim_content, content_bytes, dispute_of, identity_content, read_introduction,
                    read_task, refusal, reply_content, task_of)
from . import faults, worklog
from .volunteer import NodeConfig, answer_dispute, check, pick_device, prepare_data, work

FolderOf = Callable[[Context, str], Path]  # (context, run id) -> the node's folder
LIES = ("dtype-lie", "shape-lie", "oversize")  # faults.content's lies about an update's bytes


def content(fault: str, reply: Reply, sent: np.ndarray | dict | None) -> RecordDict:
    """The reply as a (possibly faulty) node puts it on the wire: ``faults.content``, whose
    byte lies apply to the first array of an encoded update."""
    if not isinstance(sent, dict) or fault not in LIES:
        return faults.content(fault, reply, sent)
    name = next(iter(sent))
    out = reply_content(reply, sent)
    out.array_records[UPDATE][name] = faults.content(fault, reply, sent[name]).array_records[UPDATE]["row"]
    return out


@dataclass(frozen=True)
class Node:
    """What answering a task needs of the node in ``folder``: what a warm trainer keeps."""

    folder: Path
    config: NodeConfig
    key: ec.EllipticCurvePrivateKey
    device: torch.device
    data: NodeData

    @classmethod
    def load(cls, folder: Path) -> Node:
        config = NodeConfig.load(folder)
        if config.code:  # the volunteer's own modules (its loader): importable, as at `node join`
            use_path(config.code)
        return cls(folder, config, keys.load_private(folder), pick_device(config.device),
                   NodeData.load(Path(config.data)))


def answer(node: Node, task_content: RecordDict, sent_at: float) -> RecordDict:
    """The reply content to the task ``task_content``, sent at ``sent_at`` (Unix time)."""
    task, w, spot = read_task(task_content)
    config, folder = node.config, node.folder

    def data_of(dataset: str, part: str) -> NodeData:
        return NodeData.load(prepare_data(folder, dataset, config.data_root or None, part))

    disputed = dispute_of(task_content)
    if disputed is not None:  # show the states of work this node committed to
        return _answer_dispute(node, task, w, disputed, data_of, sent_at)
    if spot is not None:  # recompute another node's update: honestly, whatever this node plays
        start = time.perf_counter()
        reply, row = check(task, w, *spot, data_of, node.key, node.device)
        seconds, out = time.perf_counter() - start, reply_content(reply, row)  # a check's reply carries no time
    else:
        reply, row = work(task, w, node.data, node.key, node.device, config.attack, folder, config.part)
        if config.slow > 0:  # a slow volunteer: a random delay, so replies arrive in a random order
            time.sleep(random.uniform(0, config.slow))
        time.sleep(faults.delay(config.attack, sent_at, task.deadline))
        seconds, out = reply.seconds, content(config.attack, reply, row)
    steps = 0 if reply.refused else Protocol.of(task).steps
    worklog.record(folder, reply, sent_at, seconds, steps, content_bytes(out))
    return out


def _answer_dispute(node: Node, task, w: np.ndarray, disputed: tuple[str, str, str],
                    data_of: Callable[[str, str], NodeData], sent_at: float) -> RecordDict:
    """The answer to a dispute over this node's own update (its data, what it plays) or over its
    spot check of another node's (that node's part, recomputed honestly)."""
    author, part, root = disputed
    mine = author == keys.fingerprint(node.key.public_key())
    start = time.perf_counter()
    try:
        data = node.data if mine else data_of(task.dataset, part)
    except ValueError as err:
        reply, hashes, states = refusal(task, f"cannot recompute the disputed work: {err}", author), [], None
    else:
        reply, hashes, states = answer_dispute(task, w, author, part, root, data, node.key, node.device,
                                               node.config.attack if mine else "", node.folder)
    out = claim_content(reply, hashes, states)
    worklog.record(node.folder, reply, sent_at, time.perf_counter() - start, 0 if states is None else len(hashes) - 1,
                   content_bytes(out), worklog.DISPUTE)
    return out


def make_app(folder_of: FolderOf) -> ClientApp:
    """The in-process volunteer ClientApp whose node folder is ``folder_of(context, run id)``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node = Node.load(folder_of(context, task_of(msg.content).run))
        return Message(answer(node, msg.content, msg.metadata.created_at), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """An introduction (say who this node is: its public key), or a no-op."""
        run = read_introduction(msg.content)
        if run is not None:
            key = keys.load_private(folder_of(context, run)).public_key()
            return Message(identity_content(keys.public_bytes(key)), reply_to=msg)
        return Message(RecordDict(), reply_to=msg)

    return app
