"""``robust node join``: the volunteer's light supervisor.

It keeps two processes alive for the volunteer's lifetime: the node's warm trainer
(``nodes.volunteer.trainer``: PyTorch, the model's data, the device), started again whenever it
exits, and its Flower SuperNode, whose per-task ClientApps (``nodes.volunteer.thin_app``) hand
their tasks to that trainer. The supervisor itself loads neither PyTorch nor Flower: it checks
the volunteer's files and the coordinator's certificate, has the trainer check and prepare
the rest (device, data set, attack) before the SuperNode starts, and shows the volunteer the
code bundles the coordinator asks it to run, each task the node answered and whether the
coordinator answers (``nodes.volunteer.terminal``); Flower's own log goes to ``DIR/flower.log``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from robust import keys
from robust.profiles import Profile

from .. import codetrust, launch
from . import channel
from .terminal import FLOWER_LOG, Terminal, keep_flower_log, say

RECONNECT_PAUSE = 3.0  # seconds between a SuperNode's exit and its restart
REFUSAL_GRACE = 90.0  # seconds a refused node keeps trying (Flower holds a dead node's session 60 s)
RESTART_PAUSE = 5.0  # seconds at least between two starts of the trainer (one that dies as it starts)


class Trainer:
    """The volunteer's warm trainer process, started again whenever it exits."""

    def __init__(self, folder: Path, setup: dict) -> None:
        self.folder = folder
        self.proc = launch.start_trainer(folder, own_group=False, setup=setup)
        self.started = time.monotonic()

    def wait_ready(self) -> int | None:
        """Wait until the trainer listens (``None``), or exits first (its exit code)."""
        while (code := self.proc.poll()) is None:
            try:
                channel.connect(self.folder, time.monotonic()).close()
                return None
            except channel.Absent:
                time.sleep(0.3)
        return code

    def keep_alive(self) -> None:
        """Start a fresh trainer if this one exited (it died, or a ClientApp it failed killed it)."""
        code = self.proc.poll()
        if code is None or time.monotonic() - self.started < RESTART_PAUSE:
            return
        say(f"the trainer exited ({_how(code)}): starting a fresh one")
        self.proc = launch.start_trainer(self.folder, own_group=False)  # node.json is written: no setup
        self.started = time.monotonic()

    def stop(self) -> None:
        launch.stop(self.proc)


def _how(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def node_join(folder: Path, coordinator: str, ca: Path, device: str, dataset: str, root: str | None,
              part: str, attack: str, slow: float, code: str = "", trust_code: list[str] = (), profile: str = "") -> int:
    device = use_profile(profile, device)
    key = keys.load_private(folder)
    if not ca.is_file():
        raise ValueError(f"--ca {ca} not found: ask the coordinator for its tls/ca.crt")
    if ":" not in coordinator:
        raise ValueError(f"--coordinator {coordinator!r}: write HOST:PORT, e.g. 192.0.2.7:9190")
    for sha in trust_code:
        codetrust.trust(folder, sha)
    unreachable = launch.check_certificate(coordinator, ca)
    if unreachable:
        say(f"cannot reach {coordinator} yet ({unreachable}): the node keeps trying")
    folder = folder.resolve()
    setup = {"device": device, "dataset": dataset, "root": root, "part": part, "attack": attack, "slow": float(slow),
             "code": str(Path(code).expanduser().resolve()) if code else ""}
    trainer = Trainer(folder, setup)
    try:
        failed = trainer.wait_ready()  # the trainer says what it could not take, and exits 2
        if failed is not None:
            return 2 if failed == 2 else 1
        say(f"node {keys.fingerprint(key.public_key())[:12]} joining {coordinator}: waiting for tasks (Ctrl-C to "
            f"leave); Flower's log: {folder / FLOWER_LOG}")
        return _supervise(lambda: launch.start_supernode(folder, coordinator, ca.resolve(), subprocess.PIPE,
                                                            own_group=False),
                          folder, trainer, Terminal(folder, coordinator, unreachable is None))
    except KeyboardInterrupt:
        return 130
    finally:
        trainer.stop()


def use_profile(spec: str, device: str) -> str:
    """Run this volunteer's processes (its trainer, its SuperNode's ClientApps) at the compute
    profile ``spec`` (``robust.profiles``): a CPU level is set in the environment they start
    with, which PyTorch reads once; ``cuda`` is the device. The device to use; ``ValueError``
    for a profile this machine cannot run or that contradicts ``--device``."""
    if not spec:
        return device
    chosen = Profile.parse(spec)
    if chosen.kind == "cuda":
        if device == "cpu":
            raise ValueError("--profile cuda with --device cpu: leave --device out, or choose a cpu profile")
        return "cuda"  # the trainer refuses it, saying so, where torch sees no GPU
    if device == "cuda":
        raise ValueError(f"--profile {spec} with --device cuda: leave --device out, or use --profile cuda")
    reason = chosen.refusal()
    if reason:
        raise ValueError(reason)
    os.environ.update(chosen.env())
    return "cpu"


def _ask_about_code(folder: Path, asked: set[str]) -> None:
    """Show the volunteer each code bundle the coordinator sent and this node's gate refused
    (``nodes.codetrust``), once per hash; on a terminal, ask whether to run it."""
    for sha, request in codetrust.pending(folder).items():
        (folder / codetrust.REQUESTS / f"{sha}.json").unlink(missing_ok=True)
        if sha in asked or sha in codetrust.trusted(folder):
            continue
        asked.add(sha)
        files = ", ".join(f"{name} ({size:,} B)" for name, size in request.get("files", {}).items())
        say(f"the coordinator asks this node to run its code: bundle {sha}, ClientApp {request.get('clientapp')}, "
            f"files: {files}")
        if sys.stdin.isatty() and input("run this code on this machine? [y/N] ").strip().lower() in ("y", "yes"):
            codetrust.trust(folder, sha)
            say("accepted: it runs from the coordinator's next task")
        else:
            say(f"not run (its tasks fail, saying why). To run it: robust node join ... --trust-code {sha}")


def _supervise(start: Callable[[], subprocess.Popen], folder: Path, trainer: Trainer, terminal: Terminal) -> int:
    """Run the volunteer's SuperNode (``start()``: in our process group, so stopping ``node
    join``'s group stops Flower's task processes too; its output a pipe, kept in Flower's log)
    until it is refused or we are stopped, keep its ``trainer`` alive, and keep the ``terminal``
    told.

    The coordinator's SuperLink keeps its state in memory, so a restarted coordinator no
    longer knows the nodes that were connected: it drops them (the SuperNode exits with 0)
    and registers their keys again as it starts; a dropped node reconnects. A refused node
    (exit code 1) keeps trying for ``REFUSAL_GRACE`` seconds: the coordinator may still be
    registering keys, or still hold the session of this node's previous, killed SuperNode
    (Flower releases it 60 s after its last heartbeat). Refused beyond that, it is not admitted.
    Meanwhile, code the coordinator sent that the volunteer has not accepted is shown to them."""
    refused_since, asked, public = None, set(), folder / keys.PUBLIC_FILE
    while True:
        proc = start()
        keep_flower_log(proc, folder / FLOWER_LOG)
        try:
            while (code := proc.poll()) is None:
                terminal.show()  # a task a dead trainer failed, before the trainer's restart
                _ask_about_code(folder, asked)
                trainer.keep_alive()
                time.sleep(1.0)
        except KeyboardInterrupt:
            launch.stop(proc)
            return 130
        if code == 0:
            refused_since = None
            say("the coordinator dropped this node (it restarted?): reconnecting")
        elif time.monotonic() - (refused_since := refused_since or time.monotonic()) < REFUSAL_GRACE:
            say(f"the coordinator refused this node (SuperNode exit code {code}): not admitted, or its previous "
                f"session is still open; trying again for {REFUSAL_GRACE:.0f} s")
        else:  # Flower retries an unreachable SuperLink forever: a lasting refusal is one
            say(f"the coordinator refused this node (SuperNode exit code {code}): is {public} admitted "
                f"(robust coordinator admit DIR {public})? Flower's own words are in {folder / FLOWER_LOG}")
            return code
        time.sleep(RECONNECT_PAUSE)
