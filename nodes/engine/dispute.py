"""Refereed disputes: a check that disagrees is settled on single steps, not on one number.

A spot check compares a whole update with a recomputation (``nodes.engine.spotcheck``): bit
for bit on the same compute profile, within a relative ``TOLERANCE`` across profiles. Across
profiles that number is not enough: a ReLU or max-pool tie that a 1e-7 rounding difference
flips moves a whole gradient, and local steps amplify it (an honest GPU update was once 6.7e-3
from its CPU recomputation), while a forged update scaled by 0.999 is only 1e-3 away. So a
disagreement does not convict; it opens a dispute (Verde, Arun et al., Gensyn 2025, settles a
training job on one disputed step):

1. The author answers with its claimed states ``s_0 .. s_K`` and their hashes
   (``nodes.engine.trajectory``; it recomputes them on its own hardware from the task).
2. The referee checks that the hashes give the root the author signed with its reply, that
   each state hashes to its entry, that ``s_0`` is the task's start ``[w, 0]`` and that the last
   state gives the signed row (``row == transmitted(local_K - w)``, bitwise: both are the
   author's own arithmetic).
3. For every step ``i`` the referee recomputes ``r_i`` from the author's own claimed
   ``s_{i-1}`` (:func:`~nodes.engine.training.redo_step`) and measures the step's gap

       gap_i = ||s_i - r_i|| / ||r_i - s_{i-1}||

   (float64): how far the claimed step lands from the recomputed one, relative to the step's
   length. One step from one state leaves hardware little to amplify, so an honest gap is
   rounding (at most 1.2e-6 measured by ``python -m evaluation.disputes``; see
   ``docs/disputes.md``), except where the step met a *near-tie*: a ReLU input or a max-pool
   window within rounding of its threshold, which another machine may decide the other way
   (``nodes.engine.near_ties``). A step above the bound is recomputed with small sets of its
   near-ties resolved otherwise, and passes if one of those lands within the bound: each is a
   computation an honest machine could make. A step that did not follow the task (fewer steps,
   other data, a scaled trajectory) stays off by its whole error. Every step is checked:
   comparing states across a span of steps would let honest differences grow, and checking a
   sample would let a single bad step hide.

The author is convicted when any step's gap exceeds :data:`STEP_TOLERANCE`, when a state
does not match its commitment, when the trajectory does not start at the base or end at the
row, or when it does not answer; otherwise it is cleared and the clearance is the record
(largest step gap, steps checked, bytes, seconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from robust.params import sha256

from . import near_ties, trajectory
from .training import redo_step

STEP_TOLERANCE = 1e-5  # one step's relative gap between honest profiles: measured <= 1.2e-6; forge x0.9999: 1e-4


@dataclass
class Claim:
    """What an author answers a dispute with: the hashes ``h_0 .. h_K`` and the states."""

    hashes: list[str]
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return 32 * len(self.hashes) + sum(4 * s.numel() for s in self.states.values())


@dataclass
class Ruling:
    """A dispute's outcome: convicted or cleared, why, and what it cost."""

    guilty: bool
    reason: str
    step: int | None = None  # the step convicted on
    gap: float | None = None  # that step's gap, or (cleared) the largest
    steps_checked: int = 0
    bytes: int = 0
    seconds: float = 0.0
    near_ties: int = 0  # steps that near-ties resolved otherwise explained (``nodes.engine.near_ties``)

    def record(self) -> dict:
        return {"guilty": self.guilty, "reason": self.reason, "step": self.step, "gap": self.gap,
                "steps_checked": self.steps_checked, "bytes": self.bytes, "seconds": round(self.seconds, 4),
                "near_ties": self.near_ties}


def step_gap(before: torch.Tensor, claimed: torch.Tensor, recomputed: torch.Tensor) -> float:
    """``||claimed - recomputed|| / ||recomputed - before||`` in float64."""
    a, r, b = (t.to(torch.float64) for t in (claimed, recomputed, before))
    return float(torch.linalg.vector_norm(a - r) / torch.linalg.vector_norm(r - b).clamp_min(1e-30))


def settle(task, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, classes: int, author: str,
           row: torch.Tensor, root: str, claim: Claim | None, device: torch.device,
           sent=lambda raw: raw) -> Ruling:
    """The referee's ruling on ``author``'s ``row`` for ``task`` (base ``w``, the author's data
    ``x, y``), which it committed to with ``root``, from its answer ``claim`` (``None``: it did
    not answer in time). ``sent(raw)``: what an honest row ``raw`` travels as (a codec's
    round trip; the row itself without compression)."""
    began = time.perf_counter()

    def ruling(guilty: bool, reason: str, step: int | None = None, gap: float | None = None, checked: int = 0):
        return Ruling(guilty, reason, step, gap, checked, claim.bytes if claim else 0, time.perf_counter() - began)

    if claim is None:
        return ruling(True, "did not answer the dispute before its deadline")
    steps = len(claim.hashes) - 1
    if trajectory.root(claim.hashes) != root:
        return ruling(True, "its state hashes do not give the root it signed")
    if sorted(claim.states) != list(range(steps + 1)) or steps < 1:
        return ruling(True, f"answered {len(claim.states)} states for a trajectory of {steps} steps")
    d = w.numel()
    for i, s in sorted(claim.states.items()):
        if s.dtype != torch.float32 or s.shape != (2 * d,) or sha256(s) != claim.hashes[i]:
            return ruling(True, f"state {i} does not match its commitment", i)
    if not torch.equal(claim.states[0], trajectory.start(w)):
        return ruling(True, "its trajectory does not start at the task's base model", 0)
    if not torch.equal(sent(claim.states[steps][:d] - claim.states[0][:d]), row):
        return ruling(True, "its last state does not give the row it signed", steps)
    worst, ties = 0.0, []
    for i in range(1, steps + 1):
        found: list[near_ties.Decision] = []
        redone = redo_step(task, claim.states[i - 1], x, y, classes, author, i, device, found=found)
        gap = step_gap(claim.states[i - 1], claim.states[i], redone)
        if not gap <= STEP_TOLERANCE:  # a NaN gap too: then only near-ties may explain it
            explained = _near_tie(task, claim, x, y, classes, author, i, device, sorted(set(found)))
            if explained is None:
                return ruling(True, f"step {i} is not the task's step (gap {gap:.2e} > {STEP_TOLERANCE:g}, "
                                    f"{len(set(found))} near-ties)", i, gap, i)
            ties.append((i, len(explained)))
            gap = step_gap(claim.states[i - 1], claim.states[i], redo_step(
                task, claim.states[i - 1], x, y, classes, author, i, device, explained))
        worst = max(worst, gap)
    because = "hardware rounding" + (f" and near-ties resolved otherwise at step(s) {', '.join(str(i) for i, _ in ties)}"
                                     if ties else "")
    cleared = ruling(False, f"cleared: {because} (largest step gap {worst:.2e})", None, worst, steps)
    cleared.near_ties = len(ties)
    return cleared


def _near_tie(task, claim: Claim, x, y, classes: int, author: str, i: int, device: torch.device,
              units: list[near_ties.Decision]) -> list[near_ties.Decision] | None:
    """The smallest set of the step's fragile decisions that, resolved the other way, brings
    step ``i`` within :data:`STEP_TOLERANCE` (``nodes.engine.near_ties``); ``None``: none does."""
    for flips in near_ties.subsets(units):
        redone = redo_step(task, claim.states[i - 1], x, y, classes, author, i, device, flips)
        if step_gap(claim.states[i - 1], claim.states[i], redone) <= STEP_TOLERANCE:
            return flips
    return None
