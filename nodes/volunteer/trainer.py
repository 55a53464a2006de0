"""The volunteer's warm trainer: one process for ``robust node join``'s lifetime, answering the
tasks its thin ClientApps (``nodes.volunteer.thin_app``) hand it over the node's local channel
(``nodes.volunteer.channel``).

It loads once what every task's process used to load: PyTorch, the node's key, ``node.json``,
its prepared data and its device (the CUDA context made at start), and answers each task with
:func:`nodes.volunteer.client_app.answer`, the function an in-process ClientApp calls: the same
bits, signed with the node's key. One task at a time, as its SuperNode sends them. It runs
robust's own models and data sets only: a task on the coordinator's own code is answered by
that code bundle's trainer, this module run with ``--bundle SHA DIR`` (the bundle the
volunteer accepted, installed in ``DIR``, first on its import path), which this trainer starts
as its child when a ClientApp asks (``nodes.volunteer.bundles``).

A task it cannot answer (the function raised) is answered with the error, which the ClientApp
raises as an in-process one would. A request that is not one is dropped; nothing a ClientApp
sends ends the trainer.

``python -m nodes.volunteer.trainer DIR [--setup JSON | --bundle SHA DIR]``: with ``--setup`` (``robust node
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

from robust.user_code import use_path

from .. import codetrust
from ..wire import pack, task_of, unpack
from . import channel, faults, memory
from .bundles import START, Bundles
from .client_app import Node, answer
from .volunteer import NodeConfig, check_attack, pick_device, prepare_data

REQUEST_WAIT = 60.0  # seconds a ClientApp has to send its task (it sends it at once; only a stuck one is slower)
BUNDLE_START = 120.0  # seconds a code bundle's trainer has to listen (PyTorch, the user's modules, the data)


def setup(folder: Path, device: str, dataset: str, root: str | None, part: str, attack: str, slow: float,
          code: str) -> str:
    """Check ``robust node join``'s choices, prepare the node's data, write ``node.json``;
    say what the node trains on. ``ValueError`` says what cannot be done."""
    check_attack(attack)
    chosen = pick_device(device)
    data = prepare_data(folder, dataset, root, part, code)
    NodeConfig(str(data.resolve()), device, attack, float(slow), part, root or "", code).save(folder)
    room, bound = memory.available()
    return (f"{dataset} part {part} on {chosen}" + (f", playing {attack}" if attack else "") +
            f"; {room / memory.MB:,.0f} MB free ({bound}): {memory.capacity(room)}")


def handle(node: Node, conn: socket.socket, bundles: Bundles) -> None:
    """Read one request from ``conn`` and answer it: a task, or a request to start a code
    bundle's trainer (``bundles``)."""
    try:
        header, frames = channel.receive(conn, time.monotonic() + REQUEST_WAIT)
    except channel.Gone:  # closed unasked: `node join` checking that the trainer listens
        return
    except channel.ChannelError as err:
        print(f"trainer: dropped a request that is not one ({err})", flush=True)
        return
    if START in header:
        sha = str(header[START])
        within = header.get("within")
        within = min(float(within), BUNDLE_START) if isinstance(within, (int, float)) else BUNDLE_START
        error = bundles.start(sha, str(header.get("path", "")), time.monotonic() + within)
        print(f"trainer: code bundle {sha[:12]}: " + (f"its trainer did not start: {error}" if error else
              f"its trainer listens (pid {bundles.procs[sha].pid})"), flush=True)
        try:
            channel.send(conn, {"error": error}, [])
        except OSError:
            pass
        return
    try:
        content = unpack(frames)  # the frames become the arrays: the task's model is held once
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
    """Answer requests, one at a time, until killed."""
    bundles = Bundles(node.folder)
    while True:
        conn, _ = server.accept()
        with conn:
            handle(node, conn, bundles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.volunteer.trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the node's folder (its key, node.json)")
    parser.add_argument("--setup", metavar="JSON", help="robust node join's choices, checked and prepared first")
    parser.add_argument("--bundle", nargs=2, metavar=("SHA", "DIR"),
                        help="be the trainer of the code bundle SHA the volunteer accepted, installed in DIR")
    args = parser.parse_args(argv)
    folder = Path(args.folder).resolve()
    sha = args.bundle[0] if args.bundle else ""
    try:
        said = setup(folder, **json.loads(args.setup)) if args.setup else ""
        if args.bundle:
            codetrust.check_installed(folder, sha, Path(args.bundle[1]))  # before anything of it is imported
            use_path(args.bundle[1])
            said = f"code bundle {sha[:12]}"
        node = Node.load(folder)
        if node.device.type == "cuda":
            torch.zeros(1, device=node.device)  # the CUDA context, made once
        import torch._dynamo  # noqa: F401 - what torch.func.grad loads at its first call: 2 s, once, here
        server = channel.listen(folder, sha)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except OSError as err:
        print(f"error: the trainer cannot listen on {channel.socket_path(folder, sha)} ({err})", file=sys.stderr,
              flush=True)
        return 1
    print(f"trainer ready (pid {os.getpid()})" + (f": {said}" if said else ""), flush=True)
    try:
        serve(node, server)
    except KeyboardInterrupt:  # Ctrl-C at `node join`'s terminal reaches its whole process group
        return 130


if __name__ == "__main__":
    sys.exit(main())
