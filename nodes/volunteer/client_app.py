"""The volunteer's Flower ClientApp: decode the task, :func:`nodes.volunteer.volunteer.work`, reply.

A node is a folder: its key, its prepared data and ``node.json`` (device, and for Byzantine
test nodes an attack). A deployed SuperNode's ``--node-config`` names the folder (written by
``robust node join``); the bench's Flower simulation builds the same app with
:func:`make_app`, finding each simulated node's folder from its partition id.

A spot-check task (``nodes.engine.spotcheck``) is answered by recomputing the named node's update on
its part of the data set (prepared in this node's folder the first time), honestly.

The update travels as the task's codec encodes it (``nodes.volunteer.volunteer.work``). A test node
that lies about its update's bytes (``dtype-lie``, ``shape-lie``, ``oversize``) tells the
same lie about the first array of a compressed update (:func:`content`).

Each answered task is one line of ``DIR/work.jsonl`` (run, round, seconds, declined or not),
written just before the reply leaves: the node's own account of what it sent.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from robust import keys
from robust.code import use_path

from ..engine.training import NodeData
from ..wire import UPDATE, Reply, identity_content, read_introduction, read_task, reply_content
from . import faults
from .volunteer import NodeConfig, check, pick_device, prepare_data, work

WORK_LOG = "work.jsonl"
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


def make_app(folder_of: FolderOf) -> ClientApp:
    """The volunteer ClientApp whose node folder is ``folder_of(context, run id)``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        task, w, spot = read_task(msg.content)
        folder = folder_of(context, task.run)
        config = NodeConfig.load(folder)
        if config.code:  # the volunteer's own modules (its loader): importable, as at `node join`
            use_path(config.code)
        if spot is not None:  # recompute another node's update: honestly, whatever this node plays
            def data_of(dataset: str, part: str) -> NodeData:
                return NodeData.load(prepare_data(folder, dataset, config.data_root or None, part))

            reply, row = check(task, w, *spot, data_of, keys.load_private(folder), pick_device(config.device))
            return Message(reply_content(reply, row), reply_to=msg)
        reply, row = work(task, w, NodeData.load(Path(config.data)), keys.load_private(folder),
                          pick_device(config.device), config.attack, folder, config.part)
        if config.slow > 0:  # a slow volunteer: a random delay, so replies arrive in a random order
            time.sleep(random.uniform(0, config.slow))
        time.sleep(faults.delay(config.attack, msg.metadata.created_at, task.deadline))
        with open(folder / WORK_LOG, "a") as out:
            out.write(json.dumps({"run": task.run, "round": task.round, "seconds": round(reply.seconds, 3),
                                  "declined": bool(reply.refused), "time": time.time(),
                                  "task_made": msg.metadata.created_at}) + "\n")  # when the ServerApp sent it
        return Message(content(config.attack, reply, row), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """An introduction (say who this node is: its public key), or a no-op the coordinator
        sends to a node that has not replied by mid-deadline: pulling it makes the SuperNode
        push a reply it still holds (``nodes.coordinator.server_app``)."""
        run = read_introduction(msg.content)
        if run is not None:
            key = keys.load_private(folder_of(context, run)).public_key()
            return Message(identity_content(keys.public_bytes(key)), reply_to=msg)
        return Message(RecordDict(), reply_to=msg)

    return app


app = make_app(lambda context, run: Path(str(context.node_config["folder"])))
