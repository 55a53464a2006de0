"""A round's inbox: one record per node of what its answer was, as the serve loop filed it.

Every desk (the coordinator, the bench's) files each answer once (:meth:`Inbox.accept`,
:meth:`Inbox.reject`, :meth:`Inbox.fail`); a node answers once a round. The views
(:attr:`Inbox.rows`, :attr:`Inbox.rejected`...) are read-only dictionaries by node, made from
the records: what the engine's step, the audit and the record read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .ledger import Ticket


@dataclass
class Answer:
    """One node's answer in a round."""

    row: torch.Tensor | Path | None = None  # the accepted update (in memory, or spooled)
    rejected: str = ""  # why its content was refused: a flag
    failed: str = ""  # why there is none (declined, a node error): no flag
    task: Ticket | None = None  # the task an accepted row answers
    reply: object = None  # what an accepted reply signed (``nodes.wire.Reply``)
    sha: str = ""  # the accepted update's SHA-256
    encoded: object = None  # compressed runs: the accepted encoding, or where it is spooled
    seconds: float | None = None  # the node's own training time, as it says
    waited: float | None = None  # task sent to answer filed, on the loop's clock
    size: int = 0  # bytes of its reply's arrays


def _view(name: str):
    return property(lambda self: {fp: value for fp, a in self.answers.items()
                                  if (value := getattr(a, name)) is not None and not (isinstance(value, str) and not value)},
                    doc=f"node -> its answer's ``{name}``, where it has one")


@dataclass
class Inbox:
    """A round's answers by node, and the files it wrote to the spool."""

    answers: dict[str, Answer] = field(default_factory=dict)
    spooled: set[Path] = field(default_factory=set)

    rows = _view("row")
    rejected = _view("rejected")
    failed = _view("failed")
    tasks = _view("task")
    replies = _view("reply")
    hashes = _view("sha")
    encoded = _view("encoded")
    seconds = _view("seconds")
    waited = _view("waited")
    sizes = _view("size")

    @classmethod
    def of(cls, singles: Iterable[Inbox]) -> Inbox:
        """One inbox holding the answers of ``singles`` (each one node's: an asynchronous buffer)."""
        inbox = cls()
        for single in singles:
            inbox.answers.update(single.answers)
            inbox.spooled |= single.spooled
        return inbox

    def __contains__(self, fp: str) -> bool:
        a = self.answers.get(fp)
        return a is not None and (a.row is not None or bool(a.rejected) or bool(a.failed))

    def of_node(self, fp: str) -> Answer:
        """``fp``'s record, made on its first use."""
        return self.answers.setdefault(fp, Answer())

    def accept(self, fp: str, row: torch.Tensor | Path, task: Ticket, **kept: object) -> None:
        """``fp``'s update ``row``, answering ``task`` (``kept``: its reply, SHA-256, encoding)."""
        answer = self.of_node(fp)
        answer.row, answer.task = row, task
        for name, value in kept.items():
            setattr(answer, name, value)

    def reject(self, fp: str, reason: str) -> None:
        self.of_node(fp).rejected = reason

    def fail(self, fp: str, reason: str) -> None:
        self.of_node(fp).failed = reason
