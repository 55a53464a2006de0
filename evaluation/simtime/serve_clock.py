"""The bench's simulated clock for the serve loop (``nodes.engine.serve``, ``nodes.engine.clocks``).

Every bench driver plays the product's serve loop on this clock: the in-process driver
(``evaluation.bench.drivers.inprocess``: rows computed in process) and ``robust bench --engine
flower`` (the ServerApp against simulated SuperNodes, which answer in milliseconds in whatever
order Ray schedules them). When a task leaves, the clock foresees when its reply arrives on the
cell's simulated volunteers (``evaluation.simtime.timeline.Timeline``: speed, link, the reply's
bytes, ``step-seconds``); a reply that came in counts only at that simulated time, and only once
every reply due before it has come in too (the loop waits for it). So asynchronous buffers
(FedBuff), deadlines and carried late replies are the same, to the bit, through either
transport. The clock's time is the timeline's (``Timeline.now``).

Churn (asynchronous rounds, in process): a task whose node leaves before its reply would arrive
is never answered (its reply "arrives" at its TTL, where it is given up), and a free node that
is offline gets a task when it is back: the clock moves to the next such return when nothing
arrives sooner. A simulated SuperNode cannot leave mid-task: the scenario refuses churn with the
Flower engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

from nodes.engine.clocks import Barrier
from nodes.engine.ledger import TaskLedger, Ticket

from .timeline import Timeline

LATE = "late: "  # how a reply the schedule made late is recorded (a round's ``failed``)


class SimClock:
    def __init__(self, line: Timeline, asynchronous: bool, settings_deadline: float, ids: Sequence[str] = (),
                 up: Callable[[object], int] | None = None) -> None:
        self.line, self.asynchronous, self.ids = line, asynchronous, list(ids)
        self.deadline = line.deadline
        self.life = line.life(asynchronous, settings_deadline)
        self.up = up or (lambda handle: line.up)  # bytes of the reply to a task (a handle)
        self.arrivals: dict[object, float] = {}  # task handle -> when its reply arrives

    @property
    def t(self) -> float:
        return self.line.now

    @t.setter
    def t(self, value: float) -> None:
        self.line.now = value

    def now(self) -> float:
        return self.t

    def sent(self, ticket: Ticket) -> None:
        arrival = self.line.arrival(ticket.node, ticket.sent, self.up(ticket.handle))
        if self.asynchronous and self.line.volunteers.leaves_during(ticket.node, ticket.sent, arrival):
            arrival = ticket.expires  # never answered: given up at its TTL
        self.arrivals[ticket.handle] = arrival

    def _counts(self, ticket: Ticket, end: float) -> bool:
        return self.line.counts(self.arrivals[ticket.handle], ticket, end)

    def _back(self, ledger: TaskLedger) -> float:
        """When the next free, offline node that may be asked comes back (``inf``: none)."""
        people, t = self.line.volunteers, self.t
        return min((people.back_at(n, t) for n in self.ids
                    if not ledger.busy(n) and not ledger.barred(n) and not people.online_at(n, t)), default=math.inf)

    def due(self, ledger: TaskLedger, landed: Collection[object]) -> list[object]:
        """The next reply to arrive (ties to the lower node id), once it has come in; a node back
        online before it moves the clock there (it gets a task); a reply past its task's TTL moves
        the clock to it (the task is then given up)."""
        out = list(ledger)
        first = min(out, key=lambda t: (self.arrivals[t.handle], t.node)) if out else None
        back = self._back(ledger) if self.asynchronous else math.inf
        if first is None or back < self.arrivals[first.handle]:
            if back < math.inf:
                self.t = max(self.t, back)
            return []
        if self.arrivals[first.handle] >= first.expires:
            self.t = max(self.t, self.arrivals[first.handle])
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

    def stepping(self) -> None:
        """The coordinator's seconds for the step (a calibration's ``collect_seconds``; none without
        one): replies that arrive meanwhile are read after it, and the next tasks leave after it."""
        self.t += self.line.coordinator_seconds

    def missed(self, ticket: Ticket, barrier: Barrier, carried: bool) -> str | None:
        late = self.arrivals[ticket.handle] - barrier.start
        return (f"{LATE}arrived {late:.3g} s after the task, deadline {self.line.deadline:g} s"
                + ("; carried to the round it arrives in" if carried else ""))
