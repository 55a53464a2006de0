"""The bench's simulated clock for the coordinator's own serve loop (``nodes.engine.clocks``).

``robust bench --engine flower`` runs the product's ServerApp loop against simulated
SuperNodes, which answer in milliseconds in whatever order Ray schedules them. With this clock
the loop's schedule is the local driver's instead: when a task leaves, the clock foresees when
its reply arrives on the cell's simulated volunteers (``evaluation.simtime.timeline.Timeline``: speed,
link, ``step-seconds``), exactly as the local driver computes it; a reply that came in counts
only at that simulated time, and only once every reply due before it has come in too (the
loop waits for it). So asynchronous buffers (FedBuff), deadlines and carried late replies are
the local driver's, to the bit. Churn is not simulated here (a simulated SuperNode cannot
leave mid-task): the scenario refuses it with this engine.
"""

from __future__ import annotations

from collections.abc import Collection

from nodes.engine.clocks import Barrier
from nodes.engine.ledger import TaskLedger, Ticket

from .timeline import Timeline


class SimClock:
    def __init__(self, line: Timeline, asynchronous: bool, settings_deadline: float) -> None:
        self.line, self.t = line, 0.0
        self.deadline = line.deadline
        self.life = line.life(asynchronous, settings_deadline)
        self.arrivals: dict[object, float] = {}  # task handle -> when its reply arrives

    def now(self) -> float:
        return self.t

    def sent(self, ticket: Ticket) -> None:
        line = self.line
        self.arrivals[ticket.handle] = line.volunteers.arrival(ticket.node, ticket.sent, line.steps, line.step_seconds,
                                                               line.up, line.down)

    def _counts(self, ticket: Ticket, end: float) -> bool:
        return self.line.counts(self.arrivals[ticket.handle], ticket, end)

    def due(self, ledger: TaskLedger, landed: Collection[object]) -> list[object]:
        """The next reply to arrive (ties to the lower node id), once it has come in; a task
        whose reply would come after its TTL moves the clock to the TTL (then it expires)."""
        out = list(ledger)
        if not out:
            return []
        first = min(out, key=lambda t: (self.arrivals[t.handle], t.node))
        if self.arrivals[first.handle] >= first.expires:
            self.t = max(self.t, first.expires)
            return []
        if first.handle not in landed:
            return []  # it has not come in yet: wait for it
        self.t = max(self.t, self.arrivals[first.handle])
        return [first.handle]

    def count(self, ledger: TaskLedger, barrier: Barrier, landed: Collection[object]) -> list[object]:
        """The replies that arrive by the round's end: the last of its own, or its deadline."""
        if barrier.end is None:
            fresh = [self.arrivals[t.handle] for t in ledger if t.number == barrier.number]
            barrier.end = self.line.round_end(barrier.start, fresh)
        return [t.handle for t in ledger if t.handle in landed and self._counts(t, barrier.end)]

    def over(self, ledger: TaskLedger, barrier: Barrier) -> bool:
        if any(self._counts(t, barrier.end) for t in ledger):
            return False
        self.t = barrier.end
        return True
