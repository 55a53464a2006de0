"""The task ledger: every task out, from the moment it is issued until it is answered, expires,
or its node is quarantined. The one answer, for every driver and every round mode, to who has
a task out, from which model, whether a reply still counts and how stale it is, who may still
answer.

- **Synchronous rounds** are the ledger plus a barrier: round ``t`` issues task number ``t``
  to the nodes it asks; at the round's deadline the tasks still out are cancelled
  (``late = drop``), or left out (``late = carry``): their nodes stay busy (not asked again)
  and a reply that comes later counts in the round it arrives in, with its staleness.
- **Asynchronous rounds** are the ledger plus ``nodes.engine.buffers``: every free node gets a task
  numbered by the run's task count, and its reply is filed in the buffer being filled.

A task (:class:`Ticket`) keeps what a reply to it must match (its number and the SHA-256 of
the model it carried), the model version it carried (its reply's staleness is the number of
versions the global model moved since), the model itself (a spot check recomputes the reply
from it, whatever the round mode), when it was sent and when it is given up (its TTL on the
driver's clock: wall seconds in a deployment, simulated seconds in the bench), and the
transport's handle for it (a Flower message id; the bench's in-process transport numbers its
tasks). Tickets are keyed by that handle (a lookup is O(1)) and have a kind: a training task, a
spot check (a verifier recomputes another node's task), a dispute (a node shows the states of
work it committed to, ``nodes.coordinator.arbitration``) or an introduction (a node without a
usable key is asked who it is). A node may hold several tickets of different kinds; "busy"
(one task at a time) is about training tickets only. A withdrawn training task (cancelled at a
round's end, its node quarantined) stays known by its handle until its TTL, as what the
transport still holds: its reply, if it comes, is pulled and dropped. Only the serve loop
(``nodes.engine.serve``) issues, closes, cancels and expires tickets; drivers bring only a
clock and a transport.

Who may still answer (a buffer that holds a reply from each of them leaves at once): the
nodes with a task out, and the free nodes the driver can reach now. A node that vanished
counts until its task's TTL passes, then no more: a buffer never waits for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch

from .staleness import stale_reason

TTL_SLACK = 30.0  # seconds a task lives past the round's deadline: then it is given up
TRAIN, CHECK, DISPUTE, INTRODUCE = "train", "check", "dispute", "introduce"  # the kinds of task


def ttl(deadline: float) -> float:
    """How long a task lives (and its message, in a deployment): the ``deadline`` + :data:`TTL_SLACK`."""
    return deadline + TTL_SLACK


@dataclass(frozen=True, eq=False)
class Ticket:
    """One task out: what its reply must match, and what a spot check recomputes it from."""

    node: str  # who was asked (an introduction's: the transport's address, until it says who it is)
    number: int  # the round (sync) or the run's task count (async): keys the node's batch draws
    version: int  # the model version it carried: rounds finished when it was issued
    base: str  # the SHA-256 of the model it carried
    model: torch.Tensor | None  # the model it carried (flat float32); None where only the schedule is replayed
    sent: float = 0.0  # on the driver's clock
    expires: float = math.inf  # given up at this time, on the driver's clock
    handle: object = None  # the transport's name for it (a Flower message id, the bench's task number)
    kind: str = TRAIN
    start: torch.Tensor | None = None  # the worker momentum its task continued from (nodes.engine.states), at a check

    def staleness(self, version: int) -> int:
        """Versions the model moved between this task and ``version`` (the current one)."""
        return version - self.version

    def refusal(self, number: int, base: str, version: int, max_staleness: int) -> str | None:
        """Why a reply signed for task ``number`` on model ``base`` does not answer this task, or
        is too stale at model ``version`` (``max-staleness``); ``None``: it counts."""
        if number != self.number:
            return f"signed for task {number}, its task is {self.number} (a replay?)"
        if base != self.base:
            return f"trained on base model {base[:12]}, its task {self.number} sent {self.base[:12]} (stale)"
        return stale_reason(self.staleness(version), max_staleness)


class TaskLedger:
    def __init__(self, max_staleness: int = 0, barred: Callable[[str], bool] = lambda node: False) -> None:
        self.max_staleness = max_staleness
        self.barred = barred  # quarantined or convicted: gets no task, its replies are not read
        self._out: dict[object, Ticket] = {}  # handle -> its ticket, every kind
        self._training: dict[str, Ticket] = {}  # node -> its training task out (one at a time)
        self._withdrawn: dict[object, Ticket] = {}  # handle -> a withdrawn training task, until its TTL

    def __iter__(self) -> Iterator[Ticket]:
        """The training tasks out, in canonical order."""
        return iter(sorted(self._training.values(), key=lambda t: t.node))

    def __len__(self) -> int:
        """Training tasks out."""
        return len(self._training)

    def of(self, kind: str) -> list[Ticket]:
        """The tickets of ``kind`` out, oldest first."""
        return [t for t in self._out.values() if t.kind == kind]

    def issue(self, node: str, number: int, version: int, base: str, model: torch.Tensor | None,
              now: float = 0.0, life: float = math.inf, handle: object = None, kind: str = TRAIN) -> Ticket:
        """Give ``node`` task ``number`` of ``kind`` carrying ``model`` (version ``version``,
        SHA-256 ``base``), sent at ``now`` as the transport's ``handle``, given up ``life`` later."""
        if kind == TRAIN and self.busy(node):
            raise ValueError(f"{node[:12]} has task {self._training[node].number} out (a driver's error)")
        if handle in self._out or handle in self._withdrawn:
            raise ValueError(f"handle {handle!r} is already out (a transport's error)")
        ticket = Ticket(node, number, version, base, model, now, now + life, handle, kind)
        self._out[handle] = ticket
        if kind == TRAIN:
            self._training[node] = ticket
        return ticket

    def task_of(self, node: str) -> Ticket | None:
        """``node``'s training task out, if any."""
        return self._training.get(node)

    def busy(self, node: str) -> bool:
        """Whether ``node`` has a training task out."""
        return node in self._training

    def free(self, nodes: Collection[str]) -> list[str]:
        """The ``nodes`` that may get a task now, in canonical order: none out, not barred."""
        return sorted(n for n in set(nodes) if not self.busy(n) and not self.barred(n))

    def reads(self, ticket: Ticket) -> bool:
        """Whether a reply to ``ticket`` is read: not once its node is quarantined (its training
        task is then withdrawn: as if it never answered)."""
        if ticket.kind == TRAIN and self.barred(ticket.node):
            self._withdraw(ticket)
            return False
        return True

    def handled(self, handle: object) -> Ticket | None:
        """The task the transport sent as ``handle``, if still out."""
        return self._out.get(handle)

    def pending(self) -> list[object]:
        """Every handle whose reply the transport may still hold: the tickets out and the
        withdrawn training tasks not yet past their TTL."""
        return [*self._out, *self._withdrawn]

    def in_flight(self) -> int:
        """Training tasks in the transport whose replies are not yet filed or dropped."""
        return len(self._training) + sum(t.kind == TRAIN for t in self._withdrawn.values())

    def close(self, handle: object) -> Ticket | None:
        """The task answered by the reply to ``handle``, whatever the reply holds (then it is no
        longer out); ``None``: nothing is out under that handle. A withdrawn task's handle is
        forgotten (its reply was pulled and dropped)."""
        self._withdrawn.pop(handle, None)
        ticket = self._out.pop(handle, None)
        if ticket is not None and ticket.kind == TRAIN:
            del self._training[ticket.node]
        return ticket

    def cancel(self, number: int | None = None) -> list[Ticket]:
        """Withdraw the training tasks out numbered ``number`` (every one if ``None``): their
        replies will not be read."""
        gone = [t for t in self if number is None or t.number == number]
        for t in gone:
            self._withdraw(t)
        return gone

    def withdraw(self, handle: object) -> None:
        """The task out as ``handle`` is no longer waited for: its reply, if it comes, is
        dropped (the handle is known until its TTL)."""
        ticket = self._out.get(handle)
        if ticket is not None:
            self._withdraw(ticket)

    def _withdraw(self, ticket: Ticket) -> None:
        if self._out.pop(ticket.handle, None) is not None:
            if ticket.kind == TRAIN:
                del self._training[ticket.node]
            self._withdrawn[ticket.handle] = ticket

    def expire(self, now: float) -> list[Ticket]:
        """Give up the tickets whose TTL ends by ``now`` (their nodes are free again), and forget
        the withdrawn ones past theirs; the training tasks given up, in canonical order."""
        self._withdrawn = {h: t for h, t in self._withdrawn.items() if t.expires > now}
        gone = [t for t in self._out.values() if t.expires <= now]
        for t in gone:
            self.close(t.handle)
        return sorted((t for t in gone if t.kind == TRAIN), key=lambda t: t.node)

    def may_answer(self, reachable: Collection[str]) -> set[str]:
        """Who may still answer: the nodes with a training task out and the ``reachable`` ones
        (online now) that could get one, less the barred."""
        return {n for n in set(self._training) | set(reachable) if not self.barred(n)}
