"""Named worker momenta: what makes ``momentum``-protocol work checkable by recomputation.

Under ``momentum`` a node's row is its worker momentum, ``m_t = beta m_{t-1} + g_t``, and
``m_{t-1}`` is state it carries across rounds: a round's work is a function of its task *and*
of where the node's momentum stood. A node whose reply was lost, late or left out moved its
momentum with no row seen, and a node that lets every other reply go unused would carry
state nobody could check.

So with spot checks the coordinator *names* the state each task continues from (a task's
``state``, ``nodes.wire.Task``): :data:`ZERO` for a node none of whose rows it used yet,
otherwise the SHA-256 of the node's last row a round used (that row *is* the momentum the
node kept after it: the protocol sends the momentum itself, and spot checks under
``momentum`` need ``compression = none``). A node continues from the named momentum, not
from whatever it computed since; an honest node always holds it (it keeps the momentum of
each row it sent until a task names a later one). A check then recomputes the row from the
task's model and the named momentum, which the coordinator holds: one gradient, the whole
update (``nodes.engine.referee.settle_step`` across compute profiles). Every link of a node's
chain is a row some round used, checked with the round's probability; no span of unseen work
is ever trusted.

:class:`States` is the engine's record of the named momenta (one row per node, ``n x d``
float32, kept in its checkpoint): only under ``momentum`` with ``spot-check > 0``; otherwise
tasks name nothing and nodes carry their momentum as they computed it.
"""

from __future__ import annotations

import torch

from robust.params import sha256
from robust.source import Rows

ZERO = "zero"  # a task's state: the node starts from zero momentum


class States:
    """Each node's named momentum: the last row of it that a round used."""

    def __init__(self, d: int) -> None:
        self.d = d
        self.held: dict[str, torch.Tensor] = {}
        self._sha: dict[str, str] = {}

    def named(self, node: str) -> str:
        """What ``node``'s next task continues from: :data:`ZERO` or its last used row's SHA-256."""
        return self._sha.get(node, ZERO)

    def start(self, node: str) -> torch.Tensor:
        """The momentum :meth:`named` names (a copy the caller may keep)."""
        held = self.held.get(node)
        return torch.zeros(self.d) if held is None else held.clone()

    def keep(self, ids: list[str], X: Rows) -> None:
        """The rows ``X`` of ``ids`` that a round used: their nodes' named momenta from now on."""
        for i, (fp, sha) in enumerate(zip(ids, X.sha256s())):
            self.held[fp] = X.row(i).to("cpu", torch.float32, copy=True)
            self._sha[fp] = sha

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.held)

    def load_state(self, held: dict[str, torch.Tensor]) -> None:
        self.held = {fp: t.clone() for fp, t in held.items()}
        self._sha = {fp: sha256(t) for fp, t in self.held.items()}
