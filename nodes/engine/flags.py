"""The flag policy: which nodes look Byzantine, round after round, and when to stop asking them.

One object, used the same way by the coordinator and by every bench driver, so the bench
measures the quarantines a deployment would make, false ones included. Each round a node is
flagged when

- its reply was rejected (malformed, non-finite, above the norm bound, badly signed...), or
- its row's distance to the round's coordinate-wise median (``nodes.engine.detectors``,
  ``to-median``) is above ``ratio`` times the larger of the *run's* typical distance (the
  largest median of those distances any round so far has had, this round's included) and the
  *node's own* (the geometric mean of its distances in the earlier rounds it was not flagged).

Why the run's and not the round's: as the model fits the nodes' data, most updates shrink
while a node whose data differ from the rest keeps a distance near its heterogeneity, which
the early rounds already show. Against the round's own median such a node sits 7-15x out
late in training and is quarantined though honest: measured on digits (Dirichlet 1.0, 25
nodes), 8-10 of 20 honest nodes with ``delta:steps=16`` and outer Nesterov momentum, 1-5 with
``momentum`` between rounds 63 and 98 of 100. Against the largest median so far, in float32,
the same nodes stay within 2.7x (8.8 where the median peaked at 3.3 with 16 local steps; 16.4
against 8.8 for ``momentum``). The typical distance is a median: colluders (``f < n / 2``)
can move it only within the honest rows' spread, so they cannot raise it to hide a row.

Why the node's own as well: a node the rule trims every round sends nearly the same delta each
round, and ``sign``'s error feedback inflates its 1-bit row to 5-8x; with DiLoCo's outer
Nesterov momentum (``delta:steps=16,server_lr=0.7,server_momentum=0.9,nesterov=true``) such
honest nodes drift, over tens of rounds, to 4-8x the run's typical distance. Measured on
digits (25 nodes of which 5 Byzantine, ``nnm+trimmed-mean``, 3 seeds x 5 attacks), against
the run's alone: 7-24 honest nodes quarantined per 3 cells (0-9 a cell) with ``sign`` or
``shared-sign``; with the node's own beside it: none in 60 cells (120 with mnist1d and plain
``delta:steps=16``), every attacker caught in the round it was before.
A node's own level is a geometric mean of the rounds it was *not* flagged: a row flagged
never raises its node's allowance, a node that lies from its first round has none, and a ramp
must grow more slowly than ``ratio ** (2 / t)`` a round to stay unflagged up to round ``t``.
Its costs: an attacker that sits just under ``ratio`` x the typical distance for many rounds
earns up to ``ratio ** 2`` x it (the rule, not the flag, bounds what such a row does); and a
label-flipper, which drifts out late in training as such an honest node does, is no longer
flagged: on the quick grid 4.5 of 5 were quarantined by rounds 33-45 under ``nnm+trimmed-mean``
(1.5 of 5 at most under the other rules), none now, at 0.0-0.3 pp more damage (spot checks
convict them). ``own=False`` (the ``flag-own`` setting) judges against the run's alone.

A row that a selecting rule (Krum, Multi-Krum, Bulyan, MDA) merely did not use is *not*
flagged: those rules drop honest rows every round by design. A node flagged in ``after``
rounds is quarantined: it is no longer asked. Flags never change a round's aggregate.

With a ``false_alarm`` target, a node is also quarantined when its evidence over rounds
(``nodes.engine.evidence``: a CUSUM of how atypical its update's direction is, round after round)
crosses the threshold calibrated to that target over the run's ``rounds``: the patient
attacker who never crosses a per-round threshold. With ``loss`` (the ``loss-evidence``
setting, which needs a root set) a second CUSUM accumulates the ``loss-score``, what each row
does to the root samples' loss, and the two share the target: the label-flipper, whose rows are
geometrically ordinary but raise the held-out loss a little every round.

A node whose update a spot check proved fabricated (``nodes.engine.spotcheck``) is *convicted*:
quarantined at once, whatever its flags, with the evidence kept in :attr:`convicted`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from .names import TO_MEDIAN
from . import evidence
from .evidence import Cusum

WHY = {"evidence": "evidence", "loss_evidence": "loss score"}  # what quarantined a node, by evidence stream


class FlagPolicy:
    def __init__(self, ratio: float, after: int, false_alarm: float = 0.0, rounds: int = 1, own: bool = True,
                 loss: bool = False) -> None:
        self.ratio, self.after, self.judges_own = ratio, after, own
        share = false_alarm / 2 if loss else false_alarm  # the target, split between the evidence streams
        self.evidence = Cusum(share, rounds, evidence.DIRECTION) if false_alarm else None
        self.loss_evidence = Cusum(share, rounds, evidence.LOSS) if false_alarm and loss else None
        self.flags: dict[str, int] = {}
        self.quarantined: dict[str, int] = {}  # node -> the round it was quarantined in
        self.convicted: dict[str, dict] = {}  # node -> {round, author, distance}: proved to lie
        self.why: dict[str, str] = {}  # node -> what quarantined it: "flags", "evidence", "loss score" or "convicted"
        self.typical = 0.0  # the largest median distance to the coordinate median of any round so far
        self.own: dict[str, tuple[int, float]] = {}  # node -> (its unflagged rounds, the sum of their log distances)

    def update(self, round: int, ids: list[str], scores: Mapping[str, torch.Tensor],
               rejected: Iterable[str]) -> list[str]:
        """Count round ``round``'s flags: accepted rows ``ids`` with their detector
        ``scores`` (canonical order), and the ``rejected`` nodes; return the flagged nodes."""
        flagged = set(rejected)
        if ids:
            bad = self.flags_rows(scores, ids).tolist()
            flagged |= {i for i, b in zip(ids, bad) if b}
            self.typical = max(self.typical, float(scores[TO_MEDIAN].median()))
            for i, b, x in zip(ids, bad, scores[TO_MEDIAN].tolist()):
                if self.judges_own and not b and x > 0:
                    count, logs = self.own.get(i, (0, 0.0))
                    self.own[i] = (count + 1, logs + math.log(x))
        for node in flagged:
            self.flags[node] = self.flags.get(node, 0) + 1
            if self.flags[node] >= self.after and node not in self.quarantined:
                self.quarantined[node], self.why[node] = round, "flags"
        for key, cusum in self.cusums():
            if ids and cusum.stream.score in scores:
                for node in cusum.update(ids, scores[cusum.stream.score]):
                    if node not in self.quarantined:
                        self.quarantined[node], self.why[node] = round, WHY[key]
        return sorted(flagged)

    def cusums(self) -> list[tuple[str, Cusum]]:
        """The evidence streams kept, by their key in a round's record and the policy's state."""
        return [(key, c) for key, c in (("evidence", self.evidence), ("loss_evidence", self.loss_evidence))
                if c is not None]

    def flags_rows(self, scores: Mapping[str, torch.Tensor], ids: list[str] | None = None) -> torch.Tensor:
        """The per-round rule: which rows of a round's detector ``scores`` are flagged (bool):
        farther from the median than ``ratio`` times the larger of the run's typical distance
        and the row's node's own (``ids``: the rows' nodes; without them, or for a node with no
        unflagged round yet, the run's alone). A row at a positive distance is flagged when
        every typical distance so far was 0."""
        distance = scores[TO_MEDIAN]
        typical = max(self.typical, float(distance.median()))
        if typical <= 0:
            return distance > 0
        if not (ids and self.judges_own):
            return distance > self.ratio * typical
        own = torch.tensor([self.level(i) for i in ids], dtype=distance.dtype)
        return distance > self.ratio * own.clamp(min=typical)

    def level(self, node: str) -> float:
        """``node``'s own typical distance: the geometric mean of its distances in the rounds it
        was not flagged (0 before the first, and always without ``own``)."""
        count, logs = self.own.get(node, (0, 0.0))
        return math.exp(logs / count) if count else 0.0

    def convict(self, node: str, round: int, evidence: dict) -> None:
        """Ban ``node`` from round ``round`` on: a spot check proved it lied."""
        self.convicted.setdefault(node, {"round": round, **evidence})
        if node not in self.quarantined:
            self.quarantined[node], self.why[node] = round, "convicted"

    def state(self) -> dict:
        state = {"flags": dict(self.flags), "quarantined": dict(self.quarantined), "convicted": dict(self.convicted),
                 "why": dict(self.why), "typical": self.typical,
                 "own": {node: [count, logs] for node, (count, logs) in self.own.items()}}
        state.update((key, cusum.state()) for key, cusum in self.cusums())
        return state

    def load_state(self, state: dict) -> None:
        for key, cusum in self.cusums():
            cusum.load_state(state.get(key, {}))
        self.flags = {str(k): int(v) for k, v in state["flags"].items()}
        self.quarantined = {str(k): int(v) for k, v in state["quarantined"].items()}
        self.convicted = {str(k): dict(v) for k, v in state.get("convicted", {}).items()}
        self.why = {str(k): str(v) for k, v in state.get("why", {}).items()}  # older checkpoints: none
        self.typical = float(state.get("typical", 0.0))
        self.own = {str(k): (int(v[0]), float(v[1])) for k, v in state.get("own", {}).items()}  # older: none
