"""Warm trainers for the code bundles a volunteer accepted (``nodes.codetrust``).

A task on the coordinator's own model or data set (``package.module:attribute``) comes with a
code bundle, which the volunteer's gate admits (its SHA-256 trusted) and Flower installs in
the task's ClientApp process. The ClientApp (``nodes.volunteer.thin_app``) does not train it
there, cold (PyTorch imported, the model and data rebuilt for every task): it hands it to the
bundle's own warm trainer, a process like the node's trainer (``nodes.volunteer.trainer``,
the same answer function, the same key) with the installed bundle first on its import path,
which stays loaded between tasks. A bundle's code runs in that process alone, never in the
node's trainer, which runs robust's own code only.

The node's trainer starts a bundle's trainer when a ClientApp asks it to (:func:`ensure`;
:class:`Bundles`), as its child: it dies with the node's trainer, so with ``robust node join``.
The bundle's trainer checks, before it imports anything of it, that the volunteer trusts the
bundle and that its installed files are the bundle's (``codetrust.check_installed``); else it
exits saying why, and the task is declined with those words. The latest ``KEEP`` bundles keep
a trainer (a coordinator's run ships one; a new run may ship another).

This module imports neither PyTorch nor Flower.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from .. import launch
from . import channel

KEEP = 2  # bundles with a warm trainer at once: the latest ones asked for
LOG = "log"  # a bundle trainer's output, beside its socket
ANSWER = 1.0  # seconds the node's trainer keeps, of a ClientApp's wait, to answer a start request
START = "start-bundle"  # the header key of a request to start a bundle's trainer: {START: sha, "path": folder}


def log_path(folder: Path, sha: str) -> Path:
    return channel.socket_path(folder, sha).parent / LOG


def ensure(folder: Path, sha: str, path: str, until: float) -> None:
    """Have the trainer of bundle ``sha`` (installed in ``path``) listen, asking the node's
    trainer to start it if none does (by ``until``, ``time.monotonic()``). A
    :class:`channel.ChannelError` if the node's trainer did not answer; ``RuntimeError`` if
    the bundle's trainer could not start, and why."""
    try:
        channel.connect(folder, time.monotonic(), sha).close()
        return
    except channel.Absent:
        pass
    within = max(until - time.monotonic() - ANSWER, 0.5)  # it answers before the ClientApp stops waiting
    header, _, pid = channel.ask(folder, {START: sha, "path": path, "within": within}, list, until)
    error = header.get("error")
    if not isinstance(error, str):
        raise channel.Garbled("the answer's header has no error field", pid)
    if error:
        raise RuntimeError(f"the trainer of code bundle {sha[:12]} could not start: {error}")


class Bundles:
    """The bundle trainers a node's trainer started (its children), by bundle SHA-256."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, sha: str, path: str, until: float) -> str:
        """Start the trainer of bundle ``sha`` installed in ``path`` unless it runs, and wait
        (by ``until``) until it listens: ``""``, or why it did not."""
        proc = self.procs.pop(sha, None)
        if proc is None or proc.poll() is not None:
            for old in list(self.procs)[: max(len(self.procs) - KEEP + 1, 0)]:
                launch.stop(self.procs.pop(old))
            log = log_path(self.folder, sha)
            log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            proc = launch.spawn([sys.executable, "-m", "nodes.volunteer.trainer", str(self.folder), "--bundle", sha, path],
                                self.folder / launch.FLWR_HOME, log, own_group=False)
        self.procs[sha] = proc  # the latest asked for last
        while (code := proc.poll()) is None:
            try:
                channel.connect(self.folder, time.monotonic(), sha).close()
                return ""
            except channel.Absent:
                if time.monotonic() > until:
                    return "it did not listen in time"
                time.sleep(0.2)
        lines = log_path(self.folder, sha).read_text(errors="replace").strip().splitlines()
        return f"it exited ({code}): {lines[-1] if lines else 'no output'}"
