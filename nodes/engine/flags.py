"""The flag policy: which nodes look Byzantine, round after round, and when to stop asking them.

One object, used the same way by the coordinator and by every bench driver, so the bench
measures the quarantines a deployment would make, false ones included. Each round a node is
flagged when

- its reply was rejected (malformed, non-finite, above the norm bound, badly signed...), or
- its row's distance to the round's coordinate-wise median (``nodes.engine.detectors``,
  ``to-median``) is above ``ratio`` times the *run's* typical distance: the largest median of
  those distances any round so far has had (this round's included).

Why the run's and not the round's: as the model fits the nodes' data, most updates shrink
while a node whose data differ from the rest keeps a distance near its heterogeneity, which
the early rounds already show. Against the round's own median such a node sits 7-15x out
late in training and is quarantined though honest: measured on digits (Dirichlet 1.0, 25
nodes), 8-10 of 20 honest nodes with ``delta:steps=16`` and outer Nesterov momentum, 1-5 with
``momentum`` between rounds 63 and 98 of 100. Against the largest median so far, in float32,
the same nodes stay within 2.7x (8.8 where the median peaked at 3.3 with 16 local steps; 16.4
against 8.8 for ``momentum``). Limit: a node the rule trims every round sends nearly the same
delta each round, and ``sign``'s error feedback inflates its 1-bit row to 5-8x (1.6-3x in
``int8``); with outer Nesterov momentum such nodes are still quarantined. The typical distance
is a median: colluders (``f < n / 2``) can move it only within the honest rows' spread, so
they cannot raise it to hide a row.

A row that a selecting rule (Krum, Multi-Krum, Bulyan, MDA) merely did not use is *not*
flagged: those rules drop honest rows every round by design. A node flagged in ``after``
rounds is quarantined: it is no longer asked. Flags never change a round's aggregate.

With a ``false_alarm`` target, a node is also quarantined when its evidence over rounds
(``nodes.engine.evidence``: a CUSUM of how atypical its update's direction is, round after round)
crosses the threshold calibrated to that target over the run's ``rounds``: the patient
attacker who never crosses a per-round threshold.

A node whose update a spot check proved fabricated (``nodes.engine.spotcheck``) is *convicted*:
quarantined at once, whatever its flags, with the evidence kept in :attr:`convicted`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .detectors import TO_MEDIAN
from .evidence import SCORE as EVIDENCE, Cusum


class FlagPolicy:
    def __init__(self, ratio: float, after: int, false_alarm: float = 0.0, rounds: int = 1) -> None:
        self.ratio, self.after = ratio, after
        self.evidence = Cusum(false_alarm, rounds) if false_alarm else None
        self.flags: dict[str, int] = {}
        self.quarantined: dict[str, int] = {}  # node -> the round it was quarantined in
        self.convicted: dict[str, dict] = {}  # node -> {round, author, distance}: proved to lie
        self.why: dict[str, str] = {}  # node -> what quarantined it: "flags", "evidence" or "convicted"
        self.typical = 0.0  # the largest median distance to the coordinate median of any round so far

    def update(self, round: int, ids: list[str], scores: Mapping[str, torch.Tensor],
               rejected: Iterable[str]) -> list[str]:
        """Count round ``round``'s flags: accepted rows ``ids`` with their detector
        ``scores`` (canonical order), and the ``rejected`` nodes; return the flagged nodes."""
        flagged = set(rejected)
        if ids:
            flagged |= {i for i, bad in zip(ids, self.flags_rows(scores).tolist()) if bad}
            self.typical = max(self.typical, float(scores[TO_MEDIAN].median()))
        for node in flagged:
            self.flags[node] = self.flags.get(node, 0) + 1
            if self.flags[node] >= self.after and node not in self.quarantined:
                self.quarantined[node], self.why[node] = round, "flags"
        if self.evidence is not None and ids:
            for node in self.evidence.update(ids, scores[EVIDENCE]):
                if node not in self.quarantined:
                    self.quarantined[node], self.why[node] = round, "evidence"
        return sorted(flagged)

    def flags_rows(self, scores: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The per-round rule: which rows of a round's detector ``scores`` are flagged (bool):
        farther from the median than ``ratio`` times the run's typical distance (a row at a
        positive distance when every typical distance so far was 0)."""
        distance = scores[TO_MEDIAN]
        typical = max(self.typical, float(distance.median()))
        return distance > self.ratio * typical if typical > 0 else distance > 0

    def convict(self, node: str, round: int, evidence: dict) -> None:
        """Ban ``node`` from round ``round`` on: a spot check proved it lied."""
        self.convicted.setdefault(node, {"round": round, **evidence})
        if node not in self.quarantined:
            self.quarantined[node], self.why[node] = round, "convicted"

    def state(self) -> dict:
        state = {"flags": dict(self.flags), "quarantined": dict(self.quarantined), "convicted": dict(self.convicted),
                 "why": dict(self.why), "typical": self.typical}
        if self.evidence is not None:
            state["evidence"] = self.evidence.state()
        return state

    def load_state(self, state: dict) -> None:
        if self.evidence is not None:
            self.evidence.load_state(state.get("evidence", {}))
        self.flags = {str(k): int(v) for k, v in state["flags"].items()}
        self.quarantined = {str(k): int(v) for k, v in state["quarantined"].items()}
        self.convicted = {str(k): dict(v) for k, v in state.get("convicted", {}).items()}
        self.why = {str(k): str(v) for k, v in state.get("why", {}).items()}  # older checkpoints: none
        self.typical = float(state.get("typical", 0.0))
