"""The flag policy: which nodes look Byzantine, round after round, and when to stop asking them.

One object, used the same way by the coordinator and by every bench driver, so the bench
measures the quarantines a deployment would make, false ones included. Each round a node is
flagged when

- its reply was rejected (malformed, non-finite, above the norm bound, badly signed...), or
- its row's ``distance-ratio`` score (``nodes.engine.detectors``: its distance to the round's
  coordinate-wise median over the typical such distance) is above ``ratio``.

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

from .evidence import SCORE as EVIDENCE, Cusum

SCORE = "distance-ratio"


class FlagPolicy:
    def __init__(self, ratio: float, after: int, false_alarm: float = 0.0, rounds: int = 1) -> None:
        self.ratio, self.after = ratio, after
        self.evidence = Cusum(false_alarm, rounds) if false_alarm else None
        self.flags: dict[str, int] = {}
        self.quarantined: dict[str, int] = {}  # node -> the round it was quarantined in
        self.convicted: dict[str, dict] = {}  # node -> {round, author, distance}: proved to lie
        self.why: dict[str, str] = {}  # node -> what quarantined it: "flags", "evidence" or "convicted"

    def update(self, round: int, ids: list[str], scores: Mapping[str, torch.Tensor],
               rejected: Iterable[str]) -> list[str]:
        """Count round ``round``'s flags: accepted rows ``ids`` with their detector
        ``scores`` (canonical order), and the ``rejected`` nodes; return the flagged nodes."""
        flagged = set(rejected)
        if ids:
            flagged |= {i for i, bad in zip(ids, self.flags_rows(scores).tolist()) if bad}
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
        """The per-round rule: which rows of a round's detector ``scores`` are flagged (bool)."""
        return scores[SCORE] > self.ratio

    def convict(self, node: str, round: int, evidence: dict) -> None:
        """Ban ``node`` from round ``round`` on: a spot check proved it lied."""
        self.convicted.setdefault(node, {"round": round, **evidence})
        if node not in self.quarantined:
            self.quarantined[node], self.why[node] = round, "convicted"

    def state(self) -> dict:
        state = {"flags": dict(self.flags), "quarantined": dict(self.quarantined), "convicted": dict(self.convicted),
                 "why": dict(self.why)}
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
