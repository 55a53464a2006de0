"""The ClientApp a deployed volunteer's SuperNode runs for each message: thin, it never loads
PyTorch. It hands the task, as Flower delivered it, to its own volunteer's warm trainer
(``nodes.volunteer.trainer``, kept alive by ``robust node join``) over the node's local
channel (``nodes.volunteer.channel``), and returns the reply the trainer built and signed.

The node's folder is the SuperNode's ``--node-config folder=...`` (``robust node join``
writes it). The trainer has until the task's deadline less ``MARGIN`` seconds (so that this
process's word still reaches the coordinator in time), or, for a task whose late answer still
counts (``late = carry``, ``round = async``), until its message's TTL less the margin; counted
from when the coordinator sent the task (from now, if the two machines' clocks disagree). A trainer that is not running, dies
while answering, does not answer by then or answers garbage makes the task a decline that
says so (the coordinator files it as failed: no flag); a hung or garbling trainer is killed,
and ``node join`` starts a fresh one, as it does when one dies. A task the trainer could not
answer (the answer function raised) fails with its words, as in an in-process ClientApp.

A task on the coordinator's own model or data set (``package.module:attribute``) comes with
its code bundle, which Flower installs for this process once the volunteer's gate admitted it
(``nodes.codetrust``): it is handed to that bundle's own warm trainer, started by the node's
trainer the first time (``nodes.volunteer.bundles``); the task fails, saying why, if that
trainer could not start (declined, as above, if it does not answer); the node's trainer runs
robust's own code only.

A deployed node is authenticated by Flower, never asked to introduce itself: a query is the
coordinator's no-op nudge (``nodes.coordinator.server_app``), answered with an empty reply.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from robust.user_code import is_reference

from .. import codetrust
from ..wire import REPLY, Task, check_of, pack, refusal, reply_content, task_of, unpack
from . import bundles, channel, worklog

MARGIN = 3.0  # seconds before the deadline the trainer's time is up
CLOCKS_AGREE = 30.0  # seconds: a task sent longer ago than this (or in the future) means the clocks differ


def budget(task: Task, sent_at: float, ttl: float, now: float) -> float:
    """Seconds the trainer has for ``task``, sent at ``sent_at`` in a message that lives ``ttl``
    seconds (``sent_at``: the coordinator's clock, ``now``: this machine's, Unix time)."""
    waited = now - sent_at
    span = ttl if task.late else task.deadline
    return max(span - MARGIN - (waited if 0 <= waited <= CLOCKS_AGREE else 0.0), 1.0)


def _stop(pid: int | None) -> bool:
    """SIGKILL the trainer ``pid`` (the kernel named it: ``channel.peer_pid``); whether it is gone."""
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return True


def decline(folder: Path, task: Task, task_content: RecordDict, err: channel.ChannelError, sent_at: float
            ) -> RecordDict:
    """The decline of a task (sent at ``sent_at``) the trainer did not answer, saying why; a trainer that hung or
    garbled is killed first (``node join`` starts a fresh one)."""
    what = {channel.Absent: "is not running", channel.Silent: "did not answer in time",
            channel.Gone: "died while answering", channel.Garbled: "answered garbage"}[type(err)]
    if isinstance(err, channel.Absent):
        then = "is `robust node join` running for this node? Its log says why the trainer stopped"
    elif isinstance(err, channel.Gone) or _stop(err.pid):
        then = "`robust node join` starts a fresh one"
    else:
        then = "it could not be stopped: restart `robust node join`"
    check = check_of(task_content)
    reply = refusal(task, f"this node's trainer {what} ({err}): {then}", check[0] if check else "")
    worklog.record(folder, reply, sent_at)
    return reply_content(reply, None)


def relay(folder: Path, task_content: RecordDict, sent_at: float, ttl: float, take: bool = False) -> RecordDict:
    """The reply to ``task_content`` (sent at ``sent_at``, living ``ttl`` seconds), from the
    node's warm trainer; a decline saying why if the trainer did not answer. ``RuntimeError``:
    the trainer could not answer this task, and why. ``take``: the task's arrays are handed to
    the trainer (``task_content`` keeps none: this process does not hold the model while the
    trainer trains). The reply keeps the bytes the trainer sent (no copy of its row)."""
    task = task_of(task_content)
    until = time.monotonic() + budget(task, sent_at, ttl, time.time())
    bundle = ""
    if is_reference(task.model) or is_reference(task.dataset):
        bundle = codetrust.INSTALLED.get("sha", "")
        if not bundle:
            raise RuntimeError(f"model {task.model!r} / dataset {task.dataset!r} is the coordinator's own code: it runs "
                               "only in a ClientApp this volunteer's gate started with its code bundle (robust node "
                               "join installs the gate)")
    try:
        if bundle:
            bundles.ensure(folder, bundle, codetrust.INSTALLED["path"], until)
        header, frames, pid = channel.ask(folder, {"sent_at": sent_at}, lambda: pack(task_content, take), until, bundle)
        error = header.get("error")
        if not isinstance(error, str):
            raise channel.Garbled("the answer's header has no error field", pid)
        if error:
            raise RuntimeError(f"the trainer could not answer: {error}")
        try:
            reply = unpack(frames)  # the frames become the arrays: the reply is held once
        except ValueError as err:
            raise channel.Garbled(str(err), pid) from None
        if REPLY not in reply.config_records:
            raise channel.Garbled("the answer holds no reply", pid)
        if header.get("stall") is True:  # a test fault (faults.stalls_clientapp)
            stall()
        return reply
    except channel.ChannelError as err:
        return decline(folder, task, task_content, err, sent_at)


def stall() -> None:
    """Stop this process, every thread of it, for longer than Flower's task heartbeat window
    (a helper process sends SIGSTOP, then SIGCONT): test fault ``clientapp-stall``."""
    from flwr.common import constant

    seconds = constant.HEARTBEAT_PATIENCE * constant.HEARTBEAT_DEFAULT_INTERVAL + 1.0
    subprocess.run([sys.executable, "-c", "import os, signal, sys, time; pid = int(sys.argv[1]); time.sleep(0.2); "
                    "os.kill(pid, signal.SIGSTOP); time.sleep(float(sys.argv[2])); os.kill(pid, signal.SIGCONT)",
                    str(os.getpid()), str(seconds)], check=False)


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    folder = Path(str(context.node_config["folder"]))
    return Message(relay(folder, msg.content, msg.metadata.created_at, msg.metadata.ttl, take=True), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    return Message(RecordDict(), reply_to=msg)
