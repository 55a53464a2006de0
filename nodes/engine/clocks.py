"""The serve loop's clock: what time it is, and which replies that came in count now.

A deployment runs on the wall (:class:`WallClock`): a reply counts as soon as it is pulled, a
synchronous round ends when every task of it is answered (with none sent, every carried one)
or past its deadline (each task's, from when it left: the ServerApp's window, ``in-flight``,
may send a round's tasks in waves), and a task is given up at its TTL. The bench's Flower
simulation driver hands the same loop a simulated clock (``evaluation.simtime.serve_clock``) that
foresees when each reply arrives on the cell's simulated volunteers (speed, link), so that
the loop's schedule is the local driver's, whatever order the replies physically come in.
Either clock only reads the task ledger (``nodes.engine.ledger``); the serve loop
(``nodes.engine.serve``) files what it says.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol as Interface

from .ledger import Ticket, TaskLedger, ttl


@dataclass
class Barrier:
    """A synchronous round's barrier: its task number, when it started, whether it sent any
    task, and (a simulated clock's) when it ends."""

    number: int
    start: float
    sent: bool
    end: float | None = None


class Clock(Interface):
    deadline: float  # seconds a synchronous round waits for replies
    life: float  # seconds a task lives before it is given up

    def now(self) -> float: ...

    def sent(self, ticket: Ticket) -> None:
        """``ticket`` is out."""

    def due(self, ledger: TaskLedger, landed: Collection[object]) -> list[object]:
        """Asynchronous rounds: the handles among ``landed`` (replies pulled, not yet filed)
        that count now, in order."""

    def count(self, ledger: TaskLedger, barrier: Barrier, landed: Collection[object]) -> list[object]:
        """Synchronous rounds: the handles among ``landed`` that count in ``barrier``'s round."""

    def over(self, ledger: TaskLedger, barrier: Barrier) -> bool:
        """Whether ``barrier``'s round is over (its counted replies filed)."""

    def missed(self, ticket: Ticket, barrier: Barrier, carried: bool) -> str | None:
        """Why ``ticket``, of ``barrier``'s round and still out at its end, is missing from it
        (the record's ``failed``); ``None``: just missing."""

    def stepping(self) -> None:
        """The engine steps on a round (or buffer) now: what the coordinator spends on it passes
        (on the wall, it just does; a calibrated simulated clock moves on by it)."""


class WallClock:
    """Real time, for a deployment: see the module."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.life = deadline, ttl(deadline)

    def now(self) -> float:
        return time.monotonic()

    def sent(self, ticket: Ticket) -> None:
        pass

    def due(self, ledger: TaskLedger, landed: Collection[object]) -> list[object]:
        return list(landed)

    def count(self, ledger: TaskLedger, barrier: Barrier, landed: Collection[object]) -> list[object]:
        return list(landed)

    def over(self, ledger: TaskLedger, barrier: Barrier) -> bool:
        own = [t for t in ledger if t.number == barrier.number]
        if own:  # each task has the deadline from when it left (``in-flight`` staggers them)
            return all(self.now() >= t.sent + self.deadline for t in own)
        waiting = not barrier.sent and len(ledger) > 0  # only carried tasks: wait for them
        return not waiting or self.now() >= barrier.start + self.deadline

    def missed(self, ticket: Ticket, barrier: Barrier, carried: bool) -> str | None:
        return None  # a node that did not answer in time is the record's ``missing``

    def stepping(self) -> None:
        pass
