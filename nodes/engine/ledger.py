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
transport's handle for it (a Flower message id). Drivers bring only a clock and a transport.

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


def ttl(deadline: float) -> float:
    """How long a task lives (and its message, in a deployment): the ``deadline`` + :data:`TTL_SLACK`."""
    return deadline + TTL_SLACK


@dataclass(frozen=True, eq=False)
class Ticket:
    """One task out: what its reply must match, and what a spot check recomputes it from."""

    node: str
    number: int  # the round (sync) or the run's task count (async): keys the node's batch draws
    version: int  # the model version it carried: rounds finished when it was issued
    base: str  # the SHA-256 of the model it carried
    model: torch.Tensor | None  # the model it carried (flat float32); None where only the schedule is replayed
    sent: float = 0.0  # on the driver's clock
    expires: float = math.inf  # given up at this time, on the driver's clock
    handle: object = None  # the transport's name for it (a Flower message id; the bench's reply in flight)

    def staleness(self, version: int) -> int:
        """Versions the model moved between this task and ``version`` (the current one)."""
        return version - self.version


class TaskLedger:
    def __init__(self, max_staleness: int = 0, barred: Callable[[str], bool] = lambda node: False) -> None:
        self.max_staleness = max_staleness
        self.barred = barred  # quarantined or convicted: gets no task, its replies are not read
        self.out: dict[str, Ticket] = {}  # node -> its task out (one at a time)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(sorted(self.out.values(), key=lambda t: t.node))

    def __len__(self) -> int:
        return len(self.out)

    def issue(self, node: str, number: int, version: int, base: str, model: torch.Tensor | None,
              now: float = 0.0, life: float = math.inf, handle: object = None) -> Ticket:
        """Give ``node`` task ``number`` carrying ``model`` (version ``version``, SHA-256 ``base``),
        sent at ``now`` and given up ``life`` later."""
        if self.busy(node):
            raise ValueError(f"{node[:12]} has task {self.out[node].number} out (a driver's error)")
        self.out[node] = ticket = Ticket(node, number, version, base, model, now, now + life, handle)
        return ticket

    def busy(self, node: str) -> bool:
        return node in self.out

    def free(self, nodes: Collection[str]) -> list[str]:
        """The ``nodes`` that may get a task now, in canonical order: none out, not barred."""
        return sorted(n for n in set(nodes) if not self.busy(n) and not self.barred(n))

    def reads(self, node: str) -> bool:
        """Whether a reply from ``node`` is read: not once it is quarantined (its task is then
        cancelled: as if it never answered)."""
        if self.barred(node):
            self.out.pop(node, None)
            return False
        return True

    def handled(self, handle: object) -> Ticket | None:
        """The task the transport sent as ``handle``, if still out."""
        return next((t for t in self.out.values() if t.handle == handle), None)

    def close(self, node: str) -> Ticket | None:
        """The task ``node``'s reply answers, whatever the reply holds (then it is no longer
        out); ``None``: the node has no task out."""
        return self.out.pop(node, None)

    def refusal(self, ticket: Ticket, number: int, base: str, version: int) -> str | None:
        """Why a reply signed for task ``number`` on model ``base`` does not answer ``ticket``,
        or is too stale at model ``version`` (``max-staleness``); ``None``: it counts."""
        if number != ticket.number:
            return f"signed for task {number}, its task is {ticket.number} (a replay?)"
        if base != ticket.base:
            return f"trained on base model {base[:12]}, its task {ticket.number} sent {ticket.base[:12]} (stale)"
        return stale_reason(ticket.staleness(version), self.max_staleness)

    def cancel(self, number: int | None = None) -> list[Ticket]:
        """Withdraw the tasks out numbered ``number`` (every task if ``None``): their replies
        will not be read."""
        gone = [t for t in self if number is None or t.number == number]
        for t in gone:
            del self.out[t.node]
        return gone

    def expire(self, now: float) -> list[Ticket]:
        """Give up the tasks whose TTL ends by ``now``: their nodes are free again."""
        gone = [t for t in self if t.expires <= now]
        for t in gone:
            del self.out[t.node]
        return gone

    def may_answer(self, reachable: Collection[str]) -> set[str]:
        """Who may still answer: the nodes with a task out and the ``reachable`` ones (online
        now) that could get one, less the barred."""
        return {n for n in set(self.out) | set(reachable) if not self.barred(n)}
