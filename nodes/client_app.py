"""The volunteer's Flower ClientApp: decode the task, :func:`nodes.volunteer.work`, reply.

Its SuperNode's ``--node-config`` (written by ``robust node join``) names the node's folder
(key and prepared data), its device and, for Byzantine test nodes, an attack.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from robust import keys

from .protocol import read_task, reply_content
from .volunteer import NodeData, pick_device, work

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    config = context.node_config
    folder = Path(str(config["folder"]))
    slow = float(config.get("slow", 0.0))
    task, w = read_task(msg.content)
    reply, row = work(task, w, NodeData.load(Path(str(config["data"]))), keys.load_private(folder),
                      pick_device(str(config.get("device", "auto"))), str(config.get("attack", "")), folder)
    if slow > 0:  # a slow volunteer: a random delay, so replies arrive in a random order
        time.sleep(random.uniform(0, slow))
    return Message(reply_content(reply, row), reply_to=msg)


@app.query()
def nudge(msg: Message, context: Context) -> Message:
    """A no-op the coordinator sends to a node that has not replied by mid-deadline: pulling
    it makes the SuperNode push a reply it still holds (``nodes.server_app``)."""
    return Message(RecordDict(), reply_to=msg)
