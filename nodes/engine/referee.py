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
3. For every step ``i`` the referee recomputes the step from the author's own claimed
   ``s_{i-1}`` (:func:`~nodes.engine.training.redo_step`). Replaying at the author's declared
   profile (``exact``: a coordinator runs any CPU level up to its own), it must get ``s_i`` bit
   for bit. Across profiles (a GPU author, a CPU referee) it computes the step in float32
   (``r_i``) and in float64 (``e_i``), and :func:`step_check` passes the claim when

       ||max(|s_i - e_i| - 2 ulp(e_i), 0)||  <=  max(STEP_TOLERANCE ||e_i - s_{i-1}||, ROUNDING ||r_i - e_i||):

   within a share of the step's length, or within a few times the referee's own float32 error
   (a trained model's gradient is a sum that mostly cancels, which float32 rounds coarsely on
   every machine; a small step written into a large parameter rounds to its ulp). Where the
   step met a *near-tie*, a ReLU input or a max-pool window within rounding of its threshold,
   another machine may have decided it the other way (``nodes.engine.near_ties``): a failing
   step is recomputed with small sets of its near-ties resolved otherwise, and passes if one of
   those does; each is a computation an honest machine could make. A step that did not follow
   the task (fewer steps, other data, a scaled trajectory) stays off by its whole error. Every
   step is checked: comparing states across a span of steps would let honest differences grow,
   and checking a sample would let a single bad step hide. Measured in ``docs/disputes.md``.

The author is convicted when a step fails, when a state does not match its commitment, when
the trajectory does not start at the base or end at the row, or when it does not answer;
otherwise it is cleared and the clearance is the record (largest step gap, steps checked,
bytes, seconds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from robust.params import sha256

from . import near_ties, trajectory
from .protocol import Protocol
from .training import redo_momentum, redo_step

STEP_TOLERANCE = 1e-5  # one step's relative gap between honest profiles, where its sums are well conditioned
ROUNDING = 8.0  # or this many times the referee's own float32 error on the step


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


def _excess(claimed: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """How far each claimed coordinate lies from the float64 step beyond two float32 ulps of it
    (writing a small step into a large parameter rounds to the parameter's ulp)."""
    e32 = exact.to(torch.float32).abs()
    ulp = (torch.nextafter(e32, torch.full_like(e32, float("inf"))) - e32).to(torch.float64)
    return ((claimed.to(torch.float64) - exact).abs() - 2 * ulp).clamp_min(0)


def step_check(before: torch.Tensor, claimed: torch.Tensor, own: torch.Tensor, exact: torch.Tensor
               ) -> tuple[bool, float]:
    """``(passes, gap)`` of a claimed step across profiles: ``gap = ||excess|| / ||exact - before||``
    (``exact``: the step in float64 from the claimed ``before``), which passes when at most
    :data:`STEP_TOLERANCE` or at most :data:`ROUNDING` times the referee's ``own`` float32
    step's distance from ``exact``: a step whose sums cancel is rounded coarsely on every
    machine alike."""
    length = float(torch.linalg.vector_norm(exact - before.to(torch.float64)).clamp_min(1e-30))
    off = float(torch.linalg.vector_norm(_excess(claimed, exact)))
    mine = float(torch.linalg.vector_norm(own.to(torch.float64) - exact))
    return off <= max(STEP_TOLERANCE * length, ROUNDING * mine), off / length


def settle(task, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, classes: int, author: str,
           row: torch.Tensor, root: str, claim: Claim | None, device: torch.device,
           sent=lambda raw: raw, exact: bool = False) -> Ruling:
    """The referee's ruling on ``author``'s ``row`` for ``task`` (base ``w``, the author's data
    ``x, y``), which it committed to with ``root``, from its answer ``claim`` (``None``: it did
    not answer in time). ``sent(raw)``: what an honest row ``raw`` travels as (a codec's
    round trip; the row itself without compression). ``exact``: the referee replays at the
    author's declared profile, so every step must match bit for bit."""
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
    d, width = w.numel(), Protocol.of(task).width
    for i, s in sorted(claim.states.items()):
        if s.dtype != torch.float32 or s.shape != (width * d,) or sha256(s) != claim.hashes[i]:
            return ruling(True, f"state {i} does not match its commitment", i)
    if not torch.equal(claim.states[0], trajectory.start(w, width)):
        return ruling(True, "its trajectory does not start at the task's base model", 0)
    if not torch.equal(sent(claim.states[steps][:d] - claim.states[0][:d]), row):
        return ruling(True, "its last state does not give the row it signed", steps)
    worst, ties = 0.0, []
    for i in range(1, steps + 1):
        before, claimed = claim.states[i - 1], claim.states[i]
        found: list[near_ties.Decision] = []
        redone = redo_step(task, before, x, y, classes, author, i, device, found=found)
        if torch.equal(redone, claimed):
            continue
        if exact:
            return ruling(True, f"step {i} is not the task's step at its own level (not bit for bit)", i, None, i)

        def redo(flips=(), precise=False, i=i, before=before):
            return redo_step(task, before, x, y, classes, author, i, device, flips, precise=precise)

        ok, gap = step_check(before, claimed, redone, redo(precise=True))
        if not ok:  # a NaN too: then only near-ties may explain it
            explained = _near_tie(redo, before, claimed, sorted(set(found)))
            if explained is None:
                return ruling(True, f"step {i} is not the task's step (gap {gap:.2e}, "
                                    f"{len(set(found))} near-ties)", i, gap, i)
            ties.append(i)
            gap = explained
        worst = max(worst, gap)
    because = "hardware rounding" + (f" and near-ties resolved otherwise at step(s) {', '.join(map(str, ties))}"
                                     if ties else "")
    cleared = ruling(False, f"cleared: {because} (largest step gap {worst:.2e})", None, worst, steps)
    cleared.near_ties = len(ties)
    return cleared


def settle_step(task, w: torch.Tensor, before: torch.Tensor, row: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                classes: int, author: str, device: torch.device) -> Ruling:
    """The ruling on ``author``'s ``momentum`` ``row`` for ``task`` (model ``w``) across compute
    profiles: its whole update is one step, from the momentum ``before`` its task named
    (``nodes.engine.states``) to the row, and the referee holds both ends, so the per-step rule
    (:func:`step_check`, near-ties included) applies to the row directly; nothing travels."""
    began = time.perf_counter()
    found: list[near_ties.Decision] = []

    def redo(flips=(), precise=False):
        return redo_momentum(task, w, before, x, y, classes, author, device, flips, found if not (flips or precise)
                             else None, precise)

    own = redo()
    if torch.equal(own, row):
        return Ruling(False, "cleared: bit for bit", None, 0.0, 1, 0, time.perf_counter() - began)
    ok, gap = step_check(before, row, own, redo(precise=True))
    ties = 0
    if not ok:
        explained = _near_tie(redo, before, row, sorted(set(found)))
        if explained is None:
            return Ruling(True, f"its row is not the task's step from the momentum it was named (gap {gap:.2e}, "
                                f"{len(set(found))} near-ties)", 1, gap, 1, 0, time.perf_counter() - began)
        gap, ties = explained, 1
    because = "hardware rounding" + (" and near-ties resolved otherwise" if ties else "")
    return Ruling(False, f"cleared: {because} (step gap {gap:.2e})", None, gap, 1, 0, time.perf_counter() - began,
                  ties)


def _near_tie(redo, before: torch.Tensor, claimed: torch.Tensor, units: list[near_ties.Decision]) -> float | None:
    """The gap of a step (``redo(flips, precise)`` recomputes it from ``before``) under the
    smallest set of its fragile decisions that, resolved the other way, lets ``claimed`` pass
    (``nodes.engine.near_ties``); ``None``: no set does."""
    for flips in near_ties.subsets(units):
        ok, gap = step_check(before, claimed, redo(flips), redo(flips, precise=True))
        if ok:
            return gap
    return None
