"""The bench's threat model, played through the round engine's hook (``nodes.engine.engine.ThreatHook``).

Before the rule (in a round that steps), an omniscient attacker sees the round's valid rows
and replaces those of the Byzantine nodes still asked with the rows its attack crafts from
the honest ones (colluding: one call crafts them all); the engine then validates the crafted
rows like any other. The attack is built for the ``k`` Byzantine rows present (its ``f``):
once the flag policy has quarantined some colluders, the rest calibrate on what is left (an
attack with memory, such as mimic, starts afresh with the new coalition).
After the rule, the hook measures the damage of the round: the empirical robustness
coefficient ``kappa_hat`` of the aggregate against the honest rows. Node-side attacks need
no hook: those Byzantine nodes trained on poisoned data already.
"""

from __future__ import annotations

import math
from functools import partial

import torch

import attacks
from attacks.base import OmniscientAttack
from robust.params import trained
from nodes.engine.detectors import score_round
from robust.seeds import generator
from robust.source import as_rows

from evaluation.reports.metrics import kappa_hat


class ThreatModel:
    def __init__(self, spec: str, byzantine: set[str], seed: int) -> None:
        self.spec, self.byzantine, self.seed = spec, byzantine, seed
        self.omniscient = isinstance(attacks.build(spec, 1), OmniscientAttack) and spec != "none"
        self.coalitions: dict[int, attacks.Attack] = {}  # k Byzantine rows present -> the attack for them
        self.previous: torch.Tensor | None = None  # the last aggregate, which attacks may use
        self.kappa: list[float] = []
        self.timeline = None  # the driver's evaluation.simtime.timeline.Timeline, if replies travel encoded

    def _mask(self, ids: list[str]) -> torch.Tensor:
        return torch.tensor([i in self.byzantine for i in ids], dtype=torch.bool)

    def rows(self, engine, round: int, ids: list[str], X: torch.Tensor) -> torch.Tensor:
        if not self.omniscient:
            return X
        byz = self._mask(ids)
        k = int(byz.sum())
        if k == 0 or k == len(ids):
            return X
        if k not in self.coalitions:
            self.coalitions[k] = attacks.build(self.spec, k)
        ctx = attacks.Context(n=len(ids), generator=generator(self.seed, round, "attack"), aggregator=self.aggregator(engine, ids, byz),
                              previous=self.previous, own=X[byz], round=round,
                              detectors=partial(self.scores, engine),
                              flagged=partial(engine.flags.flags_rows, ids=honest_first(ids, byz)),
                              layout=self.layout(engine),
                              step_sign=self.step_sign(engine))
        X = X.clone()
        crafted = self.coalitions[k](X[~byz], ctx).to(X.dtype)
        if self.timeline is not None:  # crafted in the decoded space, then encoded like everyone's
            crafted = self.timeline.transmit(crafted, round, [i for i, b in zip(ids, byz.tolist()) if b])
        X[byz] = crafted
        return X

    @staticmethod
    def scores(engine, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The deployment's detectors on ``rows``, as the engine scores a round: the loss score
        included where it holds a root set (an attack that searches against the detectors then
        searches against what its rows do to the held-out loss, too)."""
        return score_round(rows, engine.chain.f, effects=engine.loss_effects(as_rows(rows)))

    @staticmethod
    def aggregator(engine, ids: list[str], byz: torch.Tensor):
        """The deployed chain as an attack calls it on ``[honest rows; crafted rows]``: with the
        round's inputs (node ids in that order) when its rule needs them."""
        if not engine.chain.needs:
            return engine.chain
        return partial(engine.chain, inputs=engine.inputs(honest_first(ids, byz)))

    @staticmethod
    def layout(engine) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of the pieces of a row, in order (attacks that aim at a layer need it)."""
        return [(name, tuple(p.shape)) for name, p in trained(engine.model)]

    @staticmethod
    def step_sign(engine) -> int:
        """+1 if the protocol moves the model along the aggregate, -1 if against it: asked of
        the protocol itself, one step from zero along a positive aggregate."""
        w, _ = engine.protocol.apply(torch.zeros(1), torch.ones(1), None)
        return 1 if float(w) > 0 else -1

    def observe(self, ids: list[str], X: torch.Tensor, aggregate: torch.Tensor | None) -> None:
        honest = X[~self._mask(ids)]
        if aggregate is None or len(honest) == 0:
            self.kappa.append(math.nan)
            return
        self.kappa.append(kappa_hat(aggregate, honest))
        self.previous = aggregate


def honest_first(ids: list[str], byz: torch.Tensor) -> list[str]:
    """The round's node ids in the order an omniscient attack sees the rows: the honest
    nodes', then the colluders' (its crafted rows)."""
    return [i for i, b in zip(ids, byz.tolist()) if not b] + [i for i, b in zip(ids, byz.tolist()) if b]
