"""What a node sends with a committed trajectory, and what it answers a dispute with.

:func:`author` is a node's whole work on a task when it commits to its trajectory
(``nodes.engine.trajectory``): it trains (``nodes.engine.training.compute``, recording each
state), lets a node-side attack choose the trajectory it commits to
(:meth:`~attacks.base.NodeAttack.commit`; an honest node commits to what it computed) and
sends the row: the attack's :meth:`~attacks.base.NodeAttack.forge` of its update when it
commits to what it computed, otherwise the row its claimed last state gives. :meth:`Authored.claim`
is its answer to a dispute (an attack may answer otherwise:
:meth:`~attacks.base.NodeAttack.answer`). An honest node keeps no states: it answers by calling
:func:`author` again (``answering``), and on its own compute profile the states come back bit
for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attacks.base import Memory
from robust.params import sha256

from . import trajectory
from .referee import Claim
from .training import compute, playing


@dataclass
class Authored:
    row: torch.Tensor  # what the node sends (before a codec)
    m: torch.Tensor  # its new worker momentum
    hashes: list[str]  # of the states it committed to
    committed: list[torch.Tensor]
    answered: list[torch.Tensor]  # what it answers a dispute with

    @property
    def root(self) -> str:
        return trajectory.root(self.hashes)

    def claim(self) -> Claim:
        return Claim(list(self.hashes), dict(enumerate(self.answered)))

    def memory(self, round: int, w: torch.Tensor, computed_row: torch.Tensor) -> Memory:
        """What an attack that remembers keeps of this task (its trajectory included)."""
        return Memory(round, w, computed_row, self.committed)


def author(task, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, classes: int, node: str,
           device: torch.device, attack: str = "", m: torch.Tensor | None = None,
           last: Memory | None = None, answering: bool = False, own=None, kept: dict | None = None
           ) -> tuple[Authored, torch.Tensor]:
    """``(what node ``node`` sends and commits to for ``task``, the update it computed)``. An
    honest node keeps only its state hashes, unless it is ``answering`` a dispute (then
    ``committed`` and ``answered`` hold its states); a cheat that bends its trajectory keeps its
    states to bend them (:attr:`~attacks.base.NodeAttack.bends_trajectory`).
    ``own(K)``: the node's ``K`` more honest rows, for an attack with
    :attr:`~attacks.base.NodeAttack.estimates` (computed only then); ``kept``: :func:`compute`'s."""
    played = playing(attack, task.round)
    recorder = trajectory.Recorder(keep=answering or (played is not None and played.bends_trajectory))
    row, m = compute(task, w, x, y, classes, node, device, attack, m, last, recorder, kept)
    computed = [recorder.states[i] for i in range(len(recorder.states))]
    claimed = None if played is None else played.commit(computed, last)
    if claimed is None:
        sent = row if played is None else played.forge(
            row, None if last is None else last.row,
            own(played.estimates) if played.estimates and own is not None else None)
        authored = Authored(sent, m, list(recorder.hashes), computed, computed)
    else:
        d = w.numel()
        authored = Authored(claimed[-1][:d] - claimed[0][:d], m, [sha256(s) for s in claimed], claimed, claimed)
    if played is not None:
        authored.answered = played.answer(authored.committed, computed)
    return authored, row
