"""The volunteer's warm trainer: one process for ``robust node join``'s lifetime, answering the
tasks its thin ClientApps (``nodes.volunteer.thin_app``) hand it over the node's local channel
(``nodes.volunteer.channel``).

It loads once what every task's process used to load: PyTorch, the node's key, ``node.json``,
its prepared data and its device (the CUDA context made at start), and answers each task with
:func:`nodes.volunteer.client_app.answer`, the function an in-process ClientApp calls: the same
bits, signed with the node's key. One task at a time, as its SuperNode sends them. It runs
robust's own models and data sets only: a task on the user's own code is answered in that
task's process, where Flower installed the code bundle the volunteer accepted.

A task it cannot answer (the function raised) is answered with the error, which the ClientApp
raises as an in-process one would. A request that is not one is dropped; nothing a ClientApp
sends ends the trainer.

``python -m nodes.volunteer.trainer DIR [--setup JSON]``: with ``--setup`` (``robust node
join``'s choices: device, data set, part, attack...) it first checks them and prepares the
node's data and ``node.json``; a choice it cannot take exits 2, saying what to do.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

import torch

from ..wire import pack, task_of, unpack
from . import channel, faults
from .client_app import Node, answer
from .volunteer import NodeConfig, check_attack, pick_device, prepare_data

REQUEST_WAIT = 60.0  # seconds a ClientApp has to send its task (it sends it at once; only a stuck one is slower)


def setup(folder: Path, device: str, dataset: str, root: str | None, part: str, attack: str, slow: float,
          code: str) -> str:
    """Check ``robust node join``'s choices, prepare the node's data, write ``node.json``;
    say what the node trains on. ``ValueError`` says what cannot be done."""
    check_attack(attack)
    chosen = pick_device(device)
    data = prepare_data(folder, dataset, root, part, code)
    NodeConfig(str(data.resolve()), device, attack, float(slow), part, root or "", code).save(folder)
    return f"{dataset} part {part} on {chosen}" + (f", playing {attack}" if attack else "")


def handle(node: Node, conn: socket.socket) -> None:
    """Read one task from ``conn`` and answer it."""
    try:
        header, frames = channel.receive(conn, time.monotonic() + REQUEST_WAIT)
    except channel.Gone:  # closed unasked: `node join` checking that the trainer listens
        return
    except channel.ChannelError as err:
        print(f"trainer: dropped a request that is not one ({err})", flush=True)
        return
    try:
        content = unpack(frames)  # the frames let go as the arrays take them: the task is held once
        fault = faults.trainer_fault(node.config.attack, task_of(content).round)
        if fault == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang":
            threading.Event().wait()
        if fault == "garbage":
            channel.send(conn, {"error": ""}, [b"this is not a reply"])
            return
        stall = faults.stalls_clientapp(node.config.attack, task_of(content).round)
        out = {"error": "", **({"stall": True} if stall else {})}, pack(answer(node, content, float(header.get("sent_at", 0.0))))
    except Exception as err:  # noqa: BLE001 - the task's failure, said to the ClientApp: never the trainer's end
        out = {"error": f"{type(err).__name__}: {err}"[:2000]}, []
    try:
        channel.send(conn, *out)
    except OSError as err:  # the ClientApp is gone (Flower stopped it): the next task is another's
        print(f"trainer: the ClientApp left before its answer ({err})", flush=True)


def serve(node: Node, server: socket.socket) -> NoReturn:
    """Answer tasks, one at a time, until killed."""
    while True:
        conn, _ = server.accept()
        with conn:
            handle(node, conn)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.volunteer.trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the node's folder (its key, node.json)")
    parser.add_argument("--setup", metavar="JSON", help="robust node join's choices, checked and prepared first")
    args = parser.parse_args(argv)
    folder = Path(args.folder).resolve()
    try:
        said = setup(folder, **json.loads(args.setup)) if args.setup else ""
        node = Node.load(folder)
        if node.device.type == "cuda":
            torch.zeros(1, device=node.device)  # the CUDA context, made once
        import torch._dynamo  # noqa: F401 - what torch.func.grad loads at its first call: 2 s, once, here
        server = channel.listen(folder)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except OSError as err:
        print(f"error: the trainer cannot listen on {channel.socket_path(folder)} ({err})", file=sys.stderr, flush=True)
        return 1
    print(f"trainer ready (pid {os.getpid()})" + (f": {said}" if said else ""), flush=True)
    try:
        serve(node, server)
    except KeyboardInterrupt:  # Ctrl-C at `node join`'s terminal reaches its whole process group
        return 130


if __name__ == "__main__":
    sys.exit(main())
