"""The bench's asynchronous driver (``round = async``: FedBuff, Nguyen et al., AISTATS 2022).

Every online node is kept busy: it gets a task with the current model as soon as it has
replied (or comes back after leaving), and its reply arrives at the time the cell's
:class:`~evaluation.simtime.timeline.Timeline` gives (speed, link, codec bytes). Which reply goes into
which buffer is the deployment's schedule, ``nodes.engine.buffers``: one reply per node (a fast
node's next reply waits for a later buffer), and a buffer is full when it holds ``buffer``
*valid* replies, checked on arrival as the coordinator checks them (the row's validity, and
staleness within ``max-staleness``). Then the round engine plays one round on it, with each
row's staleness (how many aggregations happened since its task was sent), which the engine
turns into the ``staleness`` weight. Omniscient attacks craft the
Byzantine rows of each buffer through the engine's hook, as in synchronous rounds.

Every task is out in the deployment's task ledger (``nodes.engine.ledger``), with the reply in
flight as its transport handle. A node that leaves (``churn``) while its task runs never
replies: its task is given up at its TTL (``deadline`` + 30 simulated seconds, the
deployment's), and it gets a new one then, or when it is back. Who may still answer (a buffer
holding a reply from each of them leaves) is the ledger's: the nodes with a task out and the
free ones online now. Quarantined nodes get no more tasks; once fewer nodes than a buffer are
left, the run ends there (its record says how many buffers it made). The schedule is a function of the seed,
the scenario and the rows (ties in time go to the lower node id): the same cell gives the
same bits, each round's record keeps its ``staleness`` (the schedule).

Each task is computed when it is sent, from the model it carries, by the volunteer's own
function (``nodes.engine.training.compute``, node by node: tasks start from different models);
its ``round`` (which keys the node's batches) is the run's task count, so two tasks of one
node never draw the same batches.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from nodes.engine.buffers import Buffers, Full
from nodes.engine.ledger import TaskLedger, Ticket
from nodes.engine.rows import rejection_reason
from nodes.wire import Task

from evaluation.simtime.arrivals import EventQueue

EXPIRE = "expire"  # an event's payload: the node's task reached its TTL


class Reply(NamedTuple):
    """A reply as it arrived: its decoded row, the task it answers, why it is rejected (if)."""

    row: torch.Tensor
    ticket: Ticket
    reason: str | None


class FedBuff:
    def __init__(self, run) -> None:
        self.run, self.line, self.engine = run, run.timeline, run.engine
        settings = run.setup.settings
        self.buffers: Buffers[Reply] = Buffers(settings.buffer or settings.quorum_needed)
        flags = self.engine.flags
        self.ledger = TaskLedger(settings.max_staleness, lambda node: node in flags.quarantined)
        self.life = self.line.life(True, settings.deadline)
        self.ready: list[Full[Reply]] = []  # buffers filled but not yet aggregated
        self.queue = EventQueue()
        self.sent = 0  # tasks sent so far
        for node in run.ids:
            self._ask(node, 0.0)

    def _ask(self, node: str, now: float) -> None:
        """Send ``node`` a task with the current model at ``now`` (or when it is back online)."""
        line = self.line
        if self.ledger.free([node]) != [node]:
            return
        if not line.volunteers.online_at(node, now):
            self._back(node, now)
            return
        self.sent += 1
        w, base = self.engine.task_model()
        task = Task.of(self.run.setup.settings, "bench", self.sent, base)
        start = time.perf_counter()
        row = self.run.row(node, task, w)
        self.run.training += time.perf_counter() - start
        decoded, up = line.send(node, task.round, row)
        arrival = line.arrival(node, now, up)
        ticket = self.ledger.issue(node, task.round, self.engine.round, base, w, now, self.life, (arrival, decoded))
        if line.volunteers.leaves_during(node, now, arrival):  # never replies: given up at its TTL
            self.queue.push(ticket.expires, node, EXPIRE)
        else:
            self.queue.push(arrival, node, ticket)

    def _back(self, node: str, t: float) -> None:
        """``node``, offline at ``t``, asks for work again when it is back (if ever)."""
        back = self.line.volunteers.back_at(node, t)
        if back != float("inf"):
            self.queue.push(back, node, None)

    def play_round(self) -> dict | None:
        """Run events until the next buffer is aggregated; ``None`` if no node can reply, or
        fewer nodes than a buffer holds are left unquarantined (no buffer could ever fill)."""
        if self.ready:  # a reply filled two buffers at once: the second goes now
            return self._aggregate(self.ready.pop(0))
        if len(set(self.run.ids) - set(self.engine.flags.quarantined)) < self.buffers.size:
            return None
        settings = self.run.setup.settings
        while len(self.queue):
            event = self.queue.pop()
            self.line.now = event.time
            ticket = event.payload
            if isinstance(ticket, Ticket) and self.ledger.out.get(event.node) is ticket and event.time < ticket.expires:
                if not self.ledger.reads(event.node):
                    continue  # its reply is not read, and it gets no more tasks
                self.ledger.close(event.node)
                row = ticket.handle[1]
                reason = rejection_reason(row, row.numel(), settings.max_norm) or \
                    self.ledger.refusal(ticket, ticket.number, ticket.base, self.engine.round)
                online = [n for n in self.run.ids if self.line.volunteers.online_at(n, event.time)]
                everyone = self.ledger.may_answer(online)
                self.ready += self.buffers.add(event.node, Reply(row, ticket, reason), reason is None, everyone)
            else:  # back online, or a task past its TTL (its reply, if any, is not read)
                self.ledger.expire(event.time)
            record = self._aggregate(self.ready.pop(0)) if self.ready else None
            self._ask(event.node, event.time)  # after the step: its next task carries the new model
            if record is not None:
                return record
        return None

    def _aggregate(self, full: Full[Reply]) -> dict:
        """The engine's step on a full buffer: its valid rows, each with its task; the rest rejected."""
        ids = sorted(node for node, reply in full.replies.items() if reply.reason is None)
        rejected = {node: reply.reason for node, reply in full.replies.items() if reply.reason is not None}
        X = torch.stack([full.replies[i].row for i in ids]) if ids else torch.empty(0, self.engine.w.numel())
        tasks = {i: full.replies[i].ticket for i in ids}
        record = self.engine.step(sorted(full.replies), ids, X, rejected, tasks=tasks)
        record["held"] = full.held
        self.run.add(record)
        return record
