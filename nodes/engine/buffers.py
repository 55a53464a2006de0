"""FedBuff's schedule (Nguyen et al., AISTATS 2022): which replies go into which buffer.

The one schedule of asynchronous rounds, driven by the serve loop (``nodes.engine.serve``) for
the deployed coordinator and the bench alike:

- a reply is filed in the buffer being filled, **one per node**: a node already in it (with
  any reply, valid or not) has its next reply *held* for a later buffer;
- a buffer is full when it holds ``size`` **valid** replies (a rejected or failed reply is
  filed, so its record flags or notes it, but does not count), or a reply from every node that
  may still answer (``everyone``: the driver's nodes not quarantined, and, in the bench, not
  gone for good), valid or not: nothing more could
  come, and the engine's step on it (or its refusal below the quorum) records the rejections,
  whose flags quarantine their nodes, so nodes that only send rejected replies cannot stall
  the run;
- a full buffer leaves at once; the held replies then fill the next one, oldest first, one per
  node, until it is full too (which may make several buffers in a row).

Replies are opaque to the schedule (``P``: a decoded row, a node's inbox...); what the driver
does with a full buffer (the engine's step on its valid rows) is the driver's.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Generic, TypeVar

P = TypeVar("P")


@dataclass(frozen=True)
class Full(Generic[P]):
    """A buffer that left: every node's reply, and the nodes whose valid replies arrived
    meanwhile but wait for a later buffer (the record's ``held``: part of the schedule)."""

    replies: dict[str, P]
    held: list[str]


class Buffers(Generic[P]):
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a buffer holds at least 1 valid reply (got {size})")
        self.size = size
        self.filling: dict[str, tuple[P, bool]] = {}  # node -> (reply, valid)
        self.held: list[tuple[str, P, bool]] = []  # replies of nodes already in the buffer, oldest first

    @property
    def valid(self) -> int:
        """Valid replies in the buffer being filled."""
        return sum(ok for _, ok in self.filling.values())

    def full(self, everyone: Collection[str] = ()) -> bool:
        """Whether the buffer being filled is full (see the module)."""
        return self.valid >= self.size or (bool(everyone) and set(everyone) <= self.filling.keys())

    def add(self, node: str, reply: P, valid: bool, everyone: Collection[str] = ()) -> list[Full[P]]:
        """File ``node``'s ``reply``; the buffers this filled, in order (usually none or one).
        ``everyone``: the nodes that may still answer (none given: only valid replies fill)."""
        if node in self.filling:
            self.held.append((node, reply, valid))
        else:
            self.filling[node] = (reply, valid)
        full = []
        while self.full(everyone):
            replies = {node: reply for node, (reply, _) in self.filling.items()}
            waiting = sorted(node for node, _, ok in self.held if ok)
            self.filling, held, self.held = {}, self.held, []
            for node, reply, ok in held:
                if node in self.filling or self.valid >= self.size:  # refilled to the size at most
                    self.held.append((node, reply, ok))
                else:
                    self.filling[node] = (reply, ok)
            full.append(Full(replies, waiting))
        return full
