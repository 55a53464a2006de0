"""The bench's asynchronous driver (``round = async``: FedBuff, Nguyen et al., AISTATS 2022).

Every online node is kept busy: it gets a task with the current model as soon as it has
replied (or comes back after leaving), and its reply arrives at the time the cell's
:class:`~evaluation.timeline.Timeline` gives (speed, link, codec bytes). Replies go into a
buffer, one per node (a fast node's next reply waits for the following buffer); every
``buffer`` replies the round engine plays one round on them, with each row's staleness (how
many aggregations happened since its task was sent), which the engine turns into the
``staleness`` weight and the ``max-staleness`` rejection. Omniscient attacks craft the
Byzantine rows of each buffer through the engine's hook, as in synchronous rounds.

A node that leaves (``churn``) while its task runs never replies; it asks for work again when
it is back. Quarantined nodes get no more tasks; once fewer nodes than a buffer are left,
the run ends there (its record says how many buffers it made). The schedule is a function of the seed,
the scenario and the rows (ties in time go to the lower node id): the same cell gives the
same bits, each round's record keeps its ``staleness`` (the schedule).

Each task is computed when it is sent, from the model it carries, by the volunteer's own
function (``nodes.volunteer.compute``, node by node: tasks start from different models);
its ``round`` (which keys the node's batches) is the run's task count, so two tasks of one
node never draw the same batches.
"""

from __future__ import annotations

import time

import torch

from nodes.wire import Task

from .clock import EventQueue


class FedBuff:
    def __init__(self, run) -> None:
        self.run, self.line, self.engine = run, run.timeline, run.engine
        settings = run.setup.settings
        self.size = settings.buffer or settings.quorum_needed
        self.queue = EventQueue()
        self.sent = 0  # tasks sent so far
        self.buffer: dict[str, tuple[torch.Tensor, int]] = {}  # node -> (decoded row, version of its base)
        self.waiting: list[tuple[str, torch.Tensor, int]] = []  # replies of nodes already in the buffer
        for node in run.ids:
            self._ask(node, 0.0)

    def _ask(self, node: str, now: float) -> None:
        """Send ``node`` a task with the current model at ``now`` (or when it is back online)."""
        line = self.line
        if node in self.engine.flags.quarantined:
            return
        if not line.volunteers.online_at(node, now):
            self._back(node, now)
            return
        self.sent += 1
        task = Task.of(self.run.setup.settings, "bench", self.sent, self.engine.base)
        start = time.perf_counter()
        row = self.run.row(node, task)
        self.run.training += time.perf_counter() - start
        decoded, up = line.send(node, task.round, row)
        arrival = line.arrival(node, now, up)
        if line.volunteers.leaves_during(node, now, arrival):  # never replies
            self._back(node, arrival)
            return
        self.queue.push(arrival, node, (decoded, self.engine.round))

    def _back(self, node: str, t: float) -> None:
        """``node``, offline at ``t``, asks for work again when it is back (if ever)."""
        back = self.line.volunteers.back_at(node, t)
        if back != float("inf"):
            self.queue.push(back, node, None)

    def play_round(self) -> dict | None:
        """Run events until the next buffer is aggregated; ``None`` if no node can reply, or
        fewer nodes than a buffer holds are left unquarantined (no buffer could ever fill)."""
        if len(set(self.run.ids) - set(self.engine.flags.quarantined)) < self.size:
            return None
        while len(self.buffer) < self.size:
            self._take_waiting()
            if len(self.buffer) >= self.size:
                break
            if not len(self.queue):
                return None
            event = self.queue.pop()
            self.line.now = event.time
            if event.node in self.engine.flags.quarantined:
                continue  # its reply is not read, and it gets no more tasks
            if event.payload is not None:
                row, version = event.payload
                if event.node in self.buffer:
                    self.waiting.append((event.node, row, version))
                else:
                    self.buffer[event.node] = (row, version)
            if len(self.buffer) < self.size:
                self._ask(event.node, event.time)
            else:
                self._aggregate()
                self._ask(event.node, event.time)
                return self.run.records[-1]
        self._aggregate()
        return self.run.records[-1]

    def _take_waiting(self) -> None:
        """Move waiting replies of nodes no longer in the buffer into it, oldest first."""
        keep = []
        for node, row, version in self.waiting:
            if node not in self.buffer and len(self.buffer) < self.size:
                self.buffer[node] = (row, version)
            else:
                keep.append((node, row, version))
        self.waiting = keep

    def _aggregate(self) -> None:
        ids = sorted(self.buffer)
        X = torch.stack([self.buffer[i][0] for i in ids])
        staleness = {i: self.engine.round - self.buffer[i][1] for i in ids}
        self.buffer = {}
        self.run.add(self.engine.step(ids, ids, X, staleness=staleness))
