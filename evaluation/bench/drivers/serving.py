"""A bench cell on the product's serve loop (``nodes.engine.serve``): its desk and its transport.

The cell brings no loop of its own. It hands the serve loop the same ledger, barrier, carried
tasks and buffers a deployment plays, with three things of its own:

- :class:`InProcess`, the transport: a task "leaves" by having its node's row computed in
  process (a synchronous round's rows in one batched call, an asynchronous task's by the
  volunteer's own function from the model it carries), encoded and decoded as the coordinator
  decodes it, its bytes counted; every reply is at hand at once, and the clock says when it
  counts. Who is online is the cell's simulated volunteers' (``churn``);
- ``evaluation.simtime.serve_clock.SimClock``, the clock: when each reply arrives;
- :class:`BenchDesk`, the desk: a round's tasks (numbered by round, or by the run's task count
  in asynchronous rounds), the rows filed as they count (in asynchronous rounds checked on
  arrival, as the coordinator checks them: a buffer counts valid replies), and the engine's
  step with the threat model's hook on them.
"""

from __future__ import annotations

import itertools
import sys
import time

import torch

from nodes.engine.inbox import Inbox
from nodes.engine.ledger import TaskLedger, Ticket
from nodes.engine.rows import rejection_reason, stacked
from nodes.engine.serve import Landed
from nodes.wire import Task


class BenchDesk:
    """The serve loop's desk for a cell (``run``: its :class:`~evaluation.bench.drivers.inprocess.CellRun`)."""

    in_flight = sys.maxsize  # no window: a round's tasks all leave at once

    def __init__(self, run) -> None:
        self.run, self.engine, self.settings = run, run.engine, run.setup.settings
        flags = self.engine.flags
        self.ledger = TaskLedger(self.settings.max_staleness, lambda node: node in flags.quarantined)
        self.sent = 0  # tasks sent so far (async: the next task's number)

    def select(self, online: list[str]) -> list[str]:
        return self.engine.select([fp for fp in online if not self.ledger.busy(fp)])

    def free(self, online: list[str]) -> list[str]:
        return self.ledger.free(online)

    def candidates(self) -> list[str]:
        return list(self.run.ids)

    def reachable(self, online: list[str]) -> list[str]:
        return online

    def may_fill(self, size: int) -> bool:
        """Whether ``size`` nodes are left unquarantined (else no buffer could ever fill)."""
        return len(set(self.run.ids) - set(self.engine.flags.quarantined)) >= size

    def tasks(self, nodes: list[str]) -> tuple[dict[str, Task], torch.Tensor]:
        w, base = self.engine.task_model()
        if not self.settings.asynchronous:
            task = Task.of(self.settings, "bench", self.engine.round + 1, base)
            return {fp: task.continuing(self.engine.named_state(fp)) for fp in nodes}, w
        tasks = {}
        for fp in nodes:
            self.sent += 1
            tasks[fp] = Task.of(self.settings, "bench", self.sent, base)
        return tasks, w

    def model(self) -> torch.Tensor:
        return self.engine.task_model()[0]

    def file(self, ticket: Ticket, row: torch.Tensor, error: str, inbox: Inbox, waited: float) -> bool:
        """File ``row``, the reply to ``ticket``. Synchronous rounds leave its screen to the
        engine (one vectorised pass over the round's rows); an asynchronous buffer must know on
        arrival whether a reply counts: it is checked then, as the coordinator checks it."""
        if self.settings.asynchronous:
            reason = (rejection_reason(row, row.numel(), self.settings.max_norm)
                      or ticket.refusal(ticket.number, ticket.base, self.engine.round, self.settings.max_staleness))
            if reason:
                inbox.reject(ticket.node, reason)
                return False
        inbox.accept(ticket.node, row, ticket)
        return True

    def finish_round(self, asked: list[str], inbox: Inbox, started: float, checkers=None,
                     held: list[str] | None = None, missed: dict[str, str] | None = None, size: int = 0) -> dict:
        """The engine's step on the round's rows (the threat model's hook crafts in it)."""
        ids, X = stacked(inbox.rows, self.engine.w.numel())
        record = self.engine.step(asked, ids, X, inbox.rejected, missed, tasks=inbox.tasks)
        if held is not None:
            record["held"] = held
        self.run.add(record)
        return record

    def gave_up(self, tickets: list[Ticket]) -> None:
        pass  # the record's schedule says it


class InProcess:
    """The serve loop's transport for a cell: rows computed in process (see the module)."""

    live = False

    def __init__(self, run) -> None:
        self.run = run
        self.replies: dict[int, tuple[str, torch.Tensor]] = {}  # handle -> (node, its decoded row)
        self.bytes: dict[int, int] = {}  # handle -> bytes its reply takes up
        self.numbers = itertools.count()

    def online(self) -> dict[str, str]:
        """The cell's volunteers online now: in round ``t`` (sync), at the clock's time (async)."""
        run = self.run
        people = run.timeline.volunteers
        if run.desk.settings.asynchronous:
            return {fp: fp for fp in run.ids if people.online_at(fp, run.timeline.now)}
        return {fp: fp for fp in run.ids if people.online(fp, run.engine.round + 1)}

    def strangers(self) -> list:
        return []  # every node's key is the cell's own

    def ask(self, kind: str, asks: dict, life: float) -> dict:
        raise ValueError(f"the in-process bench computes its {kind} tasks itself (a driver's error)")

    def train(self, tasks: dict[str, Task], w: torch.Tensor, addresses: dict, life: float) -> dict[str, int]:
        run, nodes = self.run, list(tasks)
        start = time.perf_counter()
        rows = [run.row(fp, tasks[fp], w) for fp in nodes] if run.desk.settings.asynchronous else run.rows(nodes)
        run.training += time.perf_counter() - start
        handles = {}
        for fp, row in zip(nodes, rows):
            decoded, up = run.timeline.send(fp, tasks[fp].round, row)
            handles[fp] = handle = next(self.numbers)
            self.replies[handle], self.bytes[handle] = (fp, decoded), up
        return handles

    def pull(self, handles: list[int]) -> list[Landed]:
        return [Landed(h, *self.replies.pop(h)) for h in handles if h in self.replies]

    def pause(self) -> None:
        pass  # every reply is at hand: the clock says when it counts

    def nudge(self, silent: dict, life: float) -> None:
        pass  # an in-process node holds no reply back
