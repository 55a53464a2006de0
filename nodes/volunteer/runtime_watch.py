"""A reply Flower's runtime refused, seen by the volunteer's own ClientApp process, and logged.

A finished reply can still be lost between a volunteer's ClientApp and the coordinator. The
SuperNode ends a task whose process missed its heartbeat window (``HEARTBEAT_PATIENCE x
HEARTBEAT_DEFAULT_INTERVAL``, 60 s: a process starved of CPU, or stalled) and revokes its
token, so the push of the reply then fails (``401 Unauthorized``), or the task's heartbeat is
refused and the process is stopped before it pushes; any other failed push loses a reply the
same way. Flower logs it among the ClientApp's lines and goes on; the coordinator only sees a
node that never answered.

So the volunteer's ``flwr-clientapp`` (its code gate, :func:`nodes.codetrust.run_gated`) runs
Flower's ClientApp process under a :class:`Watch`: a push that raises, or a process that ends
with a task pulled and no reply pushed, is one line of ``DIR/work.jsonl`` with
``refused_by_runtime`` (the cause: ``nodes.volunteer.worklog.refused``), which ``robust node
join`` shows its volunteer, and one line in Flower's log. ``robust stress`` counts such a reply
as lost, with that cause.
"""

from __future__ import annotations

from pathlib import Path

from flwr.supercore.exit.exit_handler import add_exit_handler

from ..wire import check_of, task_of
from . import worklog


PUSH_REFUSED = ("the process was ended while pushing its reply: the SuperNode refused it (a 401: the task's token "
                "no longer valid, its heartbeat window missed?) or the node was stopped")
ENDED = ("the runtime ended the task before its reply was pushed (a heartbeat the SuperNode no longer accepted?) "
         "or the node was stopped")


class Watch:
    """Flower's ClientApp process for the volunteer in ``folder``, watched: :meth:`run`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.task: tuple[str, int, str] | None = None  # (run, round, kind) of the task pulled, if a task
        self.pushing = False  # its reply is being pushed
        self.settled = False  # its reply pushed, or its refusal logged

    def run(self, run_clientapp, **kwargs) -> None:
        """``run_clientapp.run_clientapp(**kwargs)`` (Flower's module, passed in: it is imported
        only in the ClientApp's process), its pull and push watched, and its end: Flower ends
        the process from its exit handlers (a refused heartbeat's SIGINT too), with a force-exit
        timer that may cut the unwinding short, so the watch's own handler runs before it."""
        pull, push = run_clientapp.pull_task_input, run_clientapp.push_message

        def pulled(client):
            message, *rest = pull(client)
            try:
                task = task_of(message.content) if message.metadata.message_type == "train" else None
                kind = worklog.CHECK if task and check_of(message.content) else worklog.TRAINING
                self.task = (task.run, task.round, kind) if task else None
            except Exception:  # noqa: BLE001 - not a task of ours: nothing to account for
                self.task = None
            return (message, *rest)

        def pushed(client, message, context) -> None:
            self.pushing = True
            try:
                push(client, message, context)
            except Exception as err:  # a 401 is no exception here: Flower's SIGINT to itself ends the process (ending)
                self.refused(f"pushing the reply failed ({type(err).__name__}: {str(err)[:300]})")
                raise
            self.settled = True

        run_clientapp.pull_task_input, run_clientapp.push_message = pulled, pushed
        add_exit_handler(self.ending, run_before_force_exit=True)
        try:
            run_clientapp.run_clientapp(**kwargs)
        finally:
            self.ending()

    def ending(self) -> None:
        """The process ends: a task pulled whose reply was not pushed is a reply lost."""
        self.refused(PUSH_REFUSED if self.pushing else ENDED)

    def refused(self, cause: str) -> None:
        if self.task is None or self.settled:
            return
        self.settled = True
        run, number, kind = self.task
        worklog.refused(self.folder, run, number, kind, cause)
        print(f"the reply to round {number} of run {run} was lost: {cause}; the coordinator counts this node "
              "as silent this round", flush=True)
